//! The terminal for the live view: raw mode and the alternate screen while it runs,
//! restored on every way out — dropped normally, on an error, and from the panic
//! hook before the panic message prints (raw mode would garble it). Keys are read
//! on a thread of their own, which polls with a timeout so that it sees the stop.

use std::io::{self, Stdout};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Once};
use std::thread::JoinHandle;
use std::time::Duration;

use ratatui::backend::CrosstermBackend;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::crossterm::{cursor, execute, terminal};
use ratatui::Terminal;
use tokio::sync::mpsc;

/// How long the key thread waits for a key before it looks at the stop flag.
const KEY_POLL: Duration = Duration::from_millis(100);

/// What the operator asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Input {
    Quit,
    /// The window changed size (or anything else that calls for a redraw).
    Redraw,
}

/// The terminal in raw mode on the alternate screen; restored when dropped.
pub(crate) struct Screen {
    pub(crate) terminal: Terminal<CrosstermBackend<Stdout>>,
    stop: Arc<AtomicBool>,
    keys: Option<JoinHandle<()>>,
}

impl Screen {
    /// Takes the terminal over; keys arrive on the returned channel.
    pub(crate) fn enter() -> io::Result<(Self, mpsc::Receiver<Input>)> {
        install_panic_hook();
        terminal::enable_raw_mode()?;
        if let Err(e) = execute!(io::stdout(), terminal::EnterAlternateScreen, cursor::Hide) {
            restore();
            return Err(e);
        }
        let terminal = match Terminal::new(CrosstermBackend::new(io::stdout())) {
            Ok(t) => t,
            Err(e) => {
                restore();
                return Err(e);
            }
        };
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel(16);
        let flag = stop.clone();
        let keys = std::thread::Builder::new()
            .name("webship-keys".into())
            .spawn(move || read_keys(&flag, &tx));
        let keys = match keys {
            Ok(handle) => handle,
            Err(e) => {
                restore();
                return Err(e);
            }
        };
        let screen = Screen {
            terminal,
            stop,
            keys: Some(keys),
        };
        Ok((screen, rx))
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(keys) = self.keys.take() {
            // It sees the flag within one poll.
            let _ = keys.join();
        }
        restore();
    }
}

/// Reads keys until `stop` is set or nobody listens.
fn read_keys(stop: &AtomicBool, tx: &mpsc::Sender<Input>) {
    while !stop.load(Ordering::Relaxed) && !tx.is_closed() {
        match event::poll(KEY_POLL) {
            Ok(false) => continue,
            Ok(true) => {}
            Err(_) => {
                // No terminal to read from any more: nothing but quitting makes sense.
                let _ = tx.blocking_send(Input::Quit);
                return;
            }
        }
        let input = match event::read() {
            Ok(Event::Key(key)) if key.kind != KeyEventKind::Release => match key.code {
                KeyCode::Char('q' | 'Q') | KeyCode::Esc => Some(Input::Quit),
                KeyCode::Char('c') if key.modifiers.contains(KeyModifiers::CONTROL) => Some(Input::Quit),
                _ => None,
            },
            Ok(Event::Resize(..)) => Some(Input::Redraw),
            Ok(_) => None,
            Err(_) => Some(Input::Quit),
        };
        if let Some(input) = input {
            if tx.blocking_send(input).is_err() {
                return;
            }
        }
    }
}

/// Leaves raw mode and the alternate screen; harmless when they were not entered.
fn restore() {
    let _ = terminal::disable_raw_mode();
    let _ = execute!(io::stdout(), terminal::LeaveAlternateScreen, cursor::Show);
}

/// Restores the terminal before a panic's message is printed (once per process).
fn install_panic_hook() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            restore();
            previous(info);
        }));
    });
}
