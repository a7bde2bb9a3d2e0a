//! The access log: one line per exchange, written from the exchange's record when it
//! is reported ([`write`]), in the generation's format (`combined` or `json`,
//! `format.rs`) and sampling, into the process's one [`Sink`] (`writer.rs`: a
//! bounded queue and a writer thread, so a response never waits for the disk).
//!
//! Sampling is per site and deterministic: a site logging a share `r` logs exchange
//! `n` when `floor(n·r)` moves, i.e. exactly one in ten for 0.1, spread evenly, with
//! no random number per request. Requests no site answered (a bad or foreign
//! `Host`, a request the driver refused) take `[log] access_sample`.

mod format;
mod writer;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use http::HeaderValue;

use super::record::{Finished, RequestLine};
use crate::config::{AccessFormat, Config};
pub(crate) use format::Entry;
pub use writer::AccessLogError;
pub(crate) use writer::{Sink, QUEUE_LINES};

/// Rates are kept in millionths.
const WHOLE: u64 = 1_000_000;

/// One site's share of the log and its exchange counter.
#[derive(Debug)]
struct Sampler {
    /// Millionths of the exchanges to log.
    rate: u64,
    seen: AtomicU64,
}

impl Sampler {
    fn new(share: f64) -> Self {
        Self {
            rate: (share.clamp(0.0, 1.0) * WHOLE as f64).round() as u64,
            seen: AtomicU64::new(0),
        }
    }

    /// Whether this exchange is logged.
    fn take(&self) -> bool {
        match self.rate {
            0 => false,
            WHOLE => true,
            rate => {
                let n = self.seen.fetch_add(1, Ordering::Relaxed);
                (n + 1) * rate / WHOLE > n * rate / WHOLE
            }
        }
    }
}

/// One generation's access log: its format and sampling over the process's sink.
#[derive(Debug)]
pub(crate) struct AccessLog {
    format: AccessFormat,
    /// By site index; one more at the end for requests no site answered.
    samplers: Box<[Sampler]>,
    sink: Arc<Sink>,
}

impl AccessLog {
    /// The log `config` asks for, or `None` when it is off.
    pub(crate) fn new(config: &Config, sink: &Arc<Sink>) -> Option<Self> {
        let log = &config.access_log;
        if !log.enabled {
            return None;
        }
        let samplers = config
            .sites
            .iter()
            .map(|s| Sampler::new(s.access_sample.unwrap_or(log.sample)))
            .chain(std::iter::once(Sampler::new(log.sample)))
            .collect();
        Some(Self {
            format: log.format,
            samplers,
            sink: sink.clone(),
        })
    }

    fn sampled(&self, site: Option<usize>) -> bool {
        let last = self.samplers.len() - 1;
        self.samplers[site.unwrap_or(last).min(last)].take()
    }
}

/// Writes the line of a finished exchange, if the log is on and samples it.
pub(crate) fn write(finished: &Finished<'_>) {
    let Some(log) = finished.ctx.access.as_ref() else {
        return;
    };
    if !log.sampled(finished.route.site) {
        return;
    }
    let line = finished.line;
    let header = |h: fn(&RequestLine) -> &Option<HeaderValue>| {
        line.and_then(|l| h(l).as_ref()).map(HeaderValue::as_bytes)
    };
    let entry = Entry {
        time: finished.time,
        peer: finished.peer,
        site: finished.site,
        mode: finished.route.mode.as_str(),
        proto: finished.proto,
        method: line.map(|l| l.method.as_str()),
        target: line.map(|l| l.uri.path_and_query().map_or("/", |p| p.as_str())),
        host: line.and_then(|l| {
            l.uri
                .authority()
                .map(|a| a.as_str())
                .or_else(|| l.host.as_ref().and_then(|h| h.to_str().ok()))
        }),
        referer: header(|l| &l.referer),
        user_agent: header(|l| &l.user_agent),
        status: finished.status,
        bytes: finished.bytes,
        ttfb: finished.ttfb,
        duration: finished.duration,
        upstream: finished.route.upstream,
        tls: finished.tls,
        ktls: finished.ktls,
        outcome: finished.outcome.as_str(),
    };
    // The line's own buffer goes through the queue to the writer: one allocation
    // per logged exchange, sized for a typical line.
    let mut out = Vec::with_capacity(256);
    match log.format {
        AccessFormat::Combined => format::combined(&entry, &mut out),
        AccessFormat::Json => format::json(&entry, &mut out),
    }
    log.sink.send(out);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_keeps_the_share_evenly() {
        let count = |share: f64, n: usize| {
            let s = Sampler::new(share);
            (0..n).filter(|_| s.take()).count()
        };
        assert_eq!(count(0.0, 1000), 0);
        assert_eq!(count(1.0, 1000), 1000);
        assert_eq!(count(0.1, 1000), 100);
        assert_eq!(count(0.25, 1000), 250);
        assert_eq!(count(0.001, 1000), 1);
        // Spread: one in every ten, not a run of ten.
        let s = Sampler::new(0.1);
        let taken: Vec<usize> = (0..30).filter(|_| s.take()).collect();
        assert_eq!(taken, [9, 19, 29]);
    }
}
