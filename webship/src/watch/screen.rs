//! The terminal view: one [`View`] drawn into a ratatui frame. Layout, top to bottom:
//! the header (and, while the daemon does not answer, a red line saying so), the
//! totals beside the latency quantiles, the busiest sites, the large transfers in
//! flight with their progress. Drawing only: the terminal itself is `term.rs`'s.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Cell, Paragraph, Row, Table};
use ratatui::Frame;

use super::model::View;
use super::text;

/// Draws `view` over the whole frame.
pub(crate) fn draw(frame: &mut Frame<'_>, view: &View) {
    let warning = text::unreachable(view);
    let totals = text::totals(view);
    // Its rows, their header and the borders.
    let top_height = u16::try_from(totals.len() + 3).unwrap_or(u16::MAX);
    let [head, status, top, sites, transfers] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(u16::from(warning.is_some())),
        Constraint::Length(top_height),
        Constraint::Min(5),
        Constraint::Min(5),
    ])
    .areas(frame.area());
    let title = format!("{}   (q: quit)", text::header(view));
    frame.render_widget(Paragraph::new(Line::from(title)).style(bold()), head);
    if let Some(line) = warning {
        let red = Style::new().fg(Color::Red).add_modifier(Modifier::BOLD);
        frame.render_widget(Paragraph::new(Line::from(line)).style(red), status);
    }
    let [left, right] =
        Layout::horizontal([Constraint::Percentage(50), Constraint::Percentage(50)]).areas(top);
    draw_totals(frame, totals, left);
    draw_latency(frame, view, right);
    draw_sites(frame, view, sites);
    draw_transfers(frame, view, transfers);
}

fn bold() -> Style {
    Style::new().add_modifier(Modifier::BOLD)
}

/// A number's cell: right-aligned, so that magnitudes line up.
fn right(s: String) -> Cell<'static> {
    Cell::from(Line::from(s).right_aligned())
}

fn draw_totals(frame: &mut Frame<'_>, totals: Vec<[String; 3]>, area: Rect) {
    let rows = totals
        .into_iter()
        .map(|[name, total, rate]| Row::new([Cell::from(name), right(total), right(rate)]));
    let widths = [
        Constraint::Min(22),
        Constraint::Length(12),
        Constraint::Length(14),
    ];
    let table = Table::new(rows, widths)
        .header(Row::new([String::new(), "total".into(), "per second".into()].map(right)).style(bold()))
        .block(Block::bordered().title(" totals "));
    frame.render_widget(table, area);
}

fn draw_latency(frame: &mut Frame<'_>, view: &View, area: Rect) {
    let rows = text::latency(view).into_iter().map(Row::new);
    let widths = [
        Constraint::Length(10),
        Constraint::Length(13),
        Constraint::Length(9),
        Constraint::Length(9),
        Constraint::Length(9),
    ];
    let table = Table::new(rows, widths)
        .header(Row::new(["time to", "over", "p50", "p90", "p99"]).style(bold()))
        .block(Block::bordered().title(" latency (estimated from the histograms) "));
    frame.render_widget(table, area);
}

fn draw_sites(frame: &mut Frame<'_>, view: &View, area: Rect) {
    let rows = view.sites.iter().map(|s| {
        Row::new([
            Cell::from(s.site.clone()),
            right(text::per_second(s.requests.per_second)),
            right(text::bytes_per_second(s.bytes_sent.per_second)),
            right(text::bytes(s.bytes_sent.total)),
            right(text::count(s.in_flight)),
        ])
    });
    let widths = [
        Constraint::Min(24),
        Constraint::Length(10),
        Constraint::Length(14),
        Constraint::Length(12),
        Constraint::Length(9),
    ];
    let table = Table::new(rows, widths)
        .header(
            Row::new([
                Cell::from("site"),
                right("req/s".into()),
                right("sent/s".into()),
                right("sent".into()),
                right("in flight".into()),
            ])
            .style(bold()),
        )
        .block(Block::bordered().title(" sites by throughput "));
    frame.render_widget(table, area);
}

fn draw_transfers(frame: &mut Frame<'_>, view: &View, area: Rect) {
    let rows = view.transfers.iter().map(|t| {
        let i = &t.info;
        Row::new([
            Cell::from(i.site.clone()),
            Cell::from(i.proto.clone()),
            Cell::from(i.peer.to_string()),
            Cell::from(i.path.clone()),
            Cell::from(format!("{} {:>3.0}%", text::bar(t.done(), 12), t.done() * 100.0)),
            right(format!(
                "{} / {}",
                text::bytes(i.sent as f64),
                text::bytes(i.total as f64)
            )),
            right(text::bytes_per_second(t.per_second)),
            right(text::duration(i.elapsed_ms as f64 / 1000.0)),
        ])
    });
    let widths = [
        Constraint::Length(18),
        Constraint::Length(5),
        Constraint::Length(21),
        Constraint::Min(12),
        Constraint::Length(17),
        Constraint::Length(21),
        Constraint::Length(12),
        Constraint::Length(8),
    ];
    let title = format!(" {} ", text::transfers_title(view));
    let header = ["site", "proto", "peer", "path", "progress"]
        .map(Cell::from)
        .into_iter()
        .chain(["sent", "rate", "for"].map(|h| right(h.into())));
    let table = Table::new(rows, widths)
        .header(Row::new(header).style(bold()))
        .block(Block::bordered().title(title));
    frame.render_widget(table, area);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::watch::exposition::parse;
    use crate::watch::model::tests::{text, transfer};
    use crate::watch::model::{Poll, Unreachable};
    use ratatui::backend::TestBackend;
    use ratatui::Terminal;
    use std::time::Duration;

    /// The frame's text, one string per row.
    fn rows(view: &View, width: u16, height: u16) -> Vec<String> {
        let mut terminal = Terminal::new(TestBackend::new(width, height)).unwrap();
        terminal.draw(|f| draw(f, view)).unwrap();
        let buffer = terminal.backend().buffer();
        (0..height)
            .map(|y| (0..width).map(|x| buffer[(x, y)].symbol()).collect::<String>())
            .collect()
    }

    fn view() -> View {
        let before = Poll::new(
            &parse(&text(10.0, 100, 0, 5, 0)).unwrap(),
            vec![transfer(1, 0, 8 << 20)],
            0,
        );
        let now = Poll::new(
            &parse(&text(11.0, 104, 0, 5, 1)).unwrap(),
            vec![transfer(1, 6 << 20, 8 << 20)],
            0,
        );
        View::new(
            "/run/webship/443.sock",
            Duration::from_secs(1),
            &now,
            Some(&before),
            Duration::from_secs(1),
        )
    }

    #[test]
    fn the_frame_shows_totals_sites_latency_and_transfers() {
        let rows = rows(&view(), 140, 40);
        let screen = rows.join("\n");
        let row = |needle: &str| {
            rows.iter()
                .find(|r| r.contains(needle))
                .unwrap_or_else(|| panic!("no row with {needle:?}:\n{screen}"))
        };
        assert!(
            rows[0].starts_with("webship 0.1.0 up 11.00 s generation 1"),
            "{screen}"
        );
        assert!(row("│requests").contains("105"), "{screen}");
        assert!(row("│requests").contains("4.0/s"), "{screen}");
        assert!(row("bytes sent").contains("6.0 MiB/s"), "{screen}");
        assert!(
            row("passthrough bytes down").contains("20 B"),
            "the last total shows:\n{screen}"
        );
        assert!(
            !screen.contains("1xx"),
            "no 1xx row before one was seen:\n{screen}"
        );
        assert!(row("first byte").contains("last interval"), "{screen}");
        let site = row("│files.test ");
        assert!(site.contains("4.0/s") && site.contains("6.0 MiB/s"), "{screen}");
        let transfer = row("/big.bin");
        for part in [
            "files.test",
            "h2",
            "127.0.0.1:40000",
            "#########---  75%",
            "6.0 MiB / 8.0 MiB",
        ] {
            assert!(transfer.contains(part), "{part:?} missing:\n{screen}");
        }
        assert!(row("transfers in flight (1 listed)").contains("┌"), "{screen}");
    }

    #[test]
    fn a_daemon_that_went_away_is_shown_in_red() {
        let mut view = view();
        view.unreachable = Some(Unreachable {
            error: "no webship answers on /run/webship/443.sock".into(),
            for_seconds: 3.0,
        });
        let mut terminal = Terminal::new(TestBackend::new(140, 40)).unwrap();
        terminal.draw(|f| draw(f, &view)).unwrap();
        let buffer = terminal.backend().buffer();
        let line: String = (0..140).map(|x| buffer[(x, 1)].symbol()).collect();
        assert!(
            line.starts_with("NOT ANSWERING for 3.00 s: no webship answers"),
            "{line}"
        );
        assert_eq!(buffer[(0, 1)].fg, Color::Red);
        // A small terminal still draws (nothing panics).
        let _ = rows(&view, 20, 6);
    }
}
