//! `webship stats --watch`: a live view of a running daemon for an operator on the
//! box. Every interval it asks the daemon's control socket for its metrics (the
//! Prometheus text, read by [`exposition`]) and its large transfers in flight, and
//! shows totals, rates, the busiest sites, latency quantiles and the transfers'
//! progress ([`model::View`]): on a terminal as a full-screen view (ratatui), else
//! as one plain-text block per interval, or one JSON object per line with `--json`.
//!
//! A daemon that stops answering is shown as such, with the last figures, and asked
//! again every interval; after [`GIVE_UP`] without an answer the watch ends with an
//! error. Every request has a timeout, so neither a wedged daemon nor a slow reload
//! holds the view: the terminal keeps reading keys while a request is out.
//!
//! A client of the control socket only: it imports `control` and nothing of the
//! daemon's serving code.

mod exposition;
mod model;
mod screen;
mod term;
mod text;

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::control::{self, Request, TransferList};
pub use exposition::ParseError;
use model::{Poll, Unreachable, View};

/// How long the daemon may go without answering before the watch gives up.
pub const GIVE_UP: Duration = Duration::from_secs(600);
/// The shortest and longest interval accepted.
pub const MIN_INTERVAL: Duration = Duration::from_millis(200);
pub const MAX_INTERVAL: Duration = Duration::from_secs(3600);
/// The longest a poll (both requests) may take.
const MAX_POLL: Duration = Duration::from_secs(10);

/// What `webship stats --watch` was asked.
#[derive(Debug, Clone)]
pub struct Options {
    /// The daemon's control socket.
    pub socket: PathBuf,
    pub interval: Duration,
    /// One JSON object per interval instead of text (never the terminal view).
    pub json: bool,
    /// Stop after this many polls (answered or not).
    pub count: Option<u64>,
}

/// Why the watch ended with an error.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error(transparent)]
    Control(#[from] control::ControlError),
    #[error("the daemon refused the `{request}` request: {message}")]
    Refused { request: &'static str, message: String },
    #[error("no answer on {} within {} s", .0.display(), MAX_POLL.as_secs())]
    Timeout(PathBuf),
    #[error(transparent)]
    Parse(#[from] ParseError),
    #[error(
        "the daemon on {} has not answered for {} s; the last error: {last}",
        .socket.display(),
        GIVE_UP.as_secs()
    )]
    GaveUp { socket: PathBuf, last: String },
    #[error("the terminal: {0}")]
    Terminal(#[source] std::io::Error),
    #[error("cannot start the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
}

/// Runs the watch until the operator quits, a signal comes, `count` polls are done,
/// the output is closed, or the daemon stays away for [`GIVE_UP`].
pub fn run(options: &Options) -> Result<(), WatchError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(WatchError::Runtime)?;
    let stdout = std::io::stdout();
    if !options.json && stdout.is_terminal() {
        runtime.block_on(live(options))
    } else {
        runtime.block_on(lines(options))
    }
}

/// One poll: the metrics, then the transfers (in that order, so that a transfer
/// that ends in between is missing from both for one interval rather than counted
/// twice).
async fn fetch(socket: &Path) -> Result<Poll, WatchError> {
    let poll = async {
        let metrics = control::call(socket, &Request::Metrics, MAX_POLL).await?;
        if !metrics.ok {
            return Err(WatchError::Refused {
                request: "metrics",
                message: metrics.message,
            });
        }
        let samples = exposition::parse(&metrics.message)?;
        let transfers = control::call(socket, &Request::Transfers, MAX_POLL).await?;
        // A daemon from before `transfers` refuses it: its metrics still show.
        let list = transfers.transfers.unwrap_or_default();
        let TransferList { listed, unlisted } = list;
        Ok(Poll::new(&samples, listed, unlisted))
    };
    tokio::time::timeout(MAX_POLL, poll)
        .await
        .unwrap_or_else(|_| Err(WatchError::Timeout(socket.to_owned())))
}

/// What the watch knows: the last two answers and whether the daemon answers now.
struct State {
    socket: PathBuf,
    interval: Duration,
    last: Option<(Poll, Instant)>,
    view: Option<View>,
}

impl State {
    fn new(options: &Options) -> Self {
        State {
            socket: options.socket.clone(),
            interval: options.interval,
            last: None,
            view: None,
        }
    }

    /// Takes a poll's result. An error is final when there has never been an
    /// answer (nothing to watch) or the daemon has been away for [`GIVE_UP`].
    fn update(&mut self, result: Result<Poll, WatchError>, now: Instant) -> Result<(), WatchError> {
        match result {
            Ok(poll) => {
                let before = self
                    .last
                    .as_ref()
                    .map(|(p, at)| (p, now.saturating_duration_since(*at)));
                let elapsed = before.map_or(Duration::ZERO, |(_, d)| d);
                let socket = self.socket.display().to_string();
                self.view = Some(View::new(
                    &socket,
                    self.interval,
                    &poll,
                    before.map(|(p, _)| p),
                    elapsed,
                ));
                self.last = Some((poll, now));
                Ok(())
            }
            Err(e) if self.view.is_none() => Err(e),
            Err(e) => {
                // Away since the last answer.
                let since = self.last.as_ref().map_or(now, |(_, at)| *at);
                let away = now.saturating_duration_since(since);
                if away >= GIVE_UP {
                    return Err(WatchError::GaveUp {
                        socket: self.socket.clone(),
                        last: e.to_string(),
                    });
                }
                if let Some(view) = &mut self.view {
                    view.unreachable = Some(Unreachable {
                        error: e.to_string(),
                        for_seconds: away.as_secs_f64(),
                    });
                }
                Ok(())
            }
        }
    }
}

/// The interval's ticks: the first at once, and a late one does not bunch up.
fn ticks(interval: Duration) -> tokio::time::Interval {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks
}

/// The text or JSON lines, one block per interval.
async fn lines(options: &Options) -> Result<(), WatchError> {
    let mut state = State::new(options);
    let mut ticks = ticks(options.interval);
    let mut stop = std::pin::pin!(stop_signal());
    let mut polls = 0u64;
    while options.count.is_none_or(|c| polls < c) {
        tokio::select! {
            _ = ticks.tick() => {}
            () = &mut stop => return Ok(()),
        }
        let result = tokio::select! {
            r = fetch(&options.socket) => r,
            () = &mut stop => return Ok(()),
        };
        polls += 1;
        state.update(result, Instant::now())?;
        let Some(view) = &state.view else { continue };
        let block = match options.json {
            true => serde_json::to_string(view).map(|mut line| {
                line.push('\n');
                line
            }),
            false => Ok(text::render(view)),
        };
        let Ok(block) = block else { continue };
        let mut out = std::io::stdout().lock();
        // A closed output (`| head`) ends the watch quietly.
        if out
            .write_all(block.as_bytes())
            .and_then(|()| out.flush())
            .is_err()
        {
            return Ok(());
        }
    }
    Ok(())
}

/// The full-screen view.
async fn live(options: &Options) -> Result<(), WatchError> {
    let mut state = State::new(options);
    // The first poll before the terminal is taken: a wrong socket is an error on
    // the normal screen.
    let first = fetch(&options.socket).await;
    state.update(first, Instant::now())?;
    let (mut screen, mut keys) = term::Screen::enter().map_err(WatchError::Terminal)?;
    let mut ticks = ticks(options.interval);
    ticks.tick().await;
    let mut stop = std::pin::pin!(stop_signal());
    let mut polls = 1u64;
    let mut pending: Option<tokio::task::JoinHandle<Result<Poll, WatchError>>> = None;
    loop {
        if let Some(view) = &state.view {
            screen
                .terminal
                .draw(|frame| screen::draw(frame, view))
                .map_err(WatchError::Terminal)?;
        }
        if options.count.is_some_and(|c| polls >= c) && pending.is_none() {
            return Ok(());
        }
        tokio::select! {
            _ = ticks.tick(), if pending.is_none() => {
                let socket = options.socket.clone();
                pending = Some(tokio::spawn(async move { fetch(&socket).await }));
            }
            joined = async {
                match pending.as_mut() {
                    Some(poll) => poll.await,
                    None => std::future::pending().await,
                }
            }, if pending.is_some() => {
                pending = None;
                polls += 1;
                let result = joined.unwrap_or_else(|e| Err(WatchError::Refused {
                    request: "metrics",
                    message: format!("the poll failed: {e}"),
                }));
                state.update(result, Instant::now())?;
            }
            input = keys.recv() => match input {
                Some(term::Input::Redraw) => {}
                Some(term::Input::Quit) | None => return Ok(()),
            },
            () = &mut stop => return Ok(()),
        }
    }
}

/// SIGINT, SIGTERM or SIGHUP: the watch ends (and the terminal is restored).
async fn stop_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let kinds = [
        SignalKind::interrupt(),
        SignalKind::terminate(),
        SignalKind::hangup(),
    ];
    let mut signals: Vec<_> = kinds.into_iter().filter_map(|k| signal(k).ok()).collect();
    if signals.is_empty() {
        return std::future::pending().await;
    }
    let any = futures_any(&mut signals);
    any.await;
}

/// Waits for the first of `signals`.
async fn futures_any(signals: &mut [tokio::signal::unix::Signal]) {
    std::future::poll_fn(|cx| {
        for s in signals.iter_mut() {
            if s.poll_recv(cx).is_ready() {
                return std::task::Poll::Ready(());
            }
        }
        std::task::Poll::Pending
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> Options {
        Options {
            socket: "/nowhere.sock".into(),
            interval: Duration::from_secs(1),
            json: false,
            count: None,
        }
    }

    fn answer(uptime: f64) -> Result<Poll, WatchError> {
        let text = model::tests::text(uptime, 1, 0, 0, 0);
        Ok(Poll::new(&exposition::parse(&text).unwrap(), vec![], 0))
    }

    fn gone() -> Result<Poll, WatchError> {
        Err(WatchError::Timeout("/nowhere.sock".into()))
    }

    #[test]
    fn a_daemon_that_goes_away_is_shown_then_given_up_on() {
        let start = Instant::now();
        let mut state = State::new(&options());
        assert!(
            state.update(gone(), start).is_err(),
            "no answer ever: nothing to watch"
        );
        state.update(answer(1.0), start).unwrap();
        state.update(gone(), start + Duration::from_secs(1)).unwrap();
        state.update(gone(), start + Duration::from_secs(4)).unwrap();
        let shown = state.view.as_ref().unwrap().unreachable.clone().unwrap();
        assert_eq!(shown.for_seconds, 4.0, "since the last answer");
        assert!(shown.error.contains("no answer on /nowhere.sock"), "{shown:?}");
        // Back: the warning goes.
        state.update(answer(5.0), start + Duration::from_secs(5)).unwrap();
        assert!(state.view.as_ref().unwrap().unreachable.is_none());
        state.update(gone(), start + Duration::from_secs(6)).unwrap();
        let late = start + Duration::from_secs(5) + GIVE_UP;
        assert!(matches!(
            state.update(gone(), late),
            Err(WatchError::GaveUp { .. })
        ));
    }
}
