//! Automatic certificates through ACME (RFC 8555): the manager that keeps every
//! ACME site's certificate slot filled and fresh.
//!
//! It owns no list of sites: each pass walks the process's certificate table for
//! slots of [`Origin::Acme`](crate::tls::certs::Origin), so a reload that adds or
//! removes an ACME site is seen at the next pass. A certificate is ordered when the
//! slot is empty, and renewed ahead of expiry: when a third of its lifetime is left
//! (less a random share, so a fleet does not renew at once), or inside the server's
//! ARI window (RFC 9773) when it offers one, never later than a tenth of its
//! lifetime before expiry and never sooner than [`SUCCESS_GAP`] after an issuance
//! (a certificate issued near its end must not start an order loop). A failure
//! keeps the old certificate serving, is logged and counted, and is retried with
//! exponential backoff up to [`BACKOFF_MAX`], whatever `Retry-After` the server
//! sends; a site with no certificate yet fails its handshakes rather than show
//! another site's. The manager task is supervised: a panic restarts it.
//! The new certificate is swapped into the slot: open connections keep theirs.
//!
//! `order` speaks the protocol (through instant-acme, over `client`, which caps
//! response bodies), `store` keeps the files.

mod client;
pub(crate) mod http01;
mod order;
mod store;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use instant_acme::{Account, CertificateIdentifier};
use tokio::sync::{oneshot, Notify};

use crate::config::AcmeSource;
use crate::control::CertInfo;
use crate::metrics::{Collector, Encoder, Kind};
use crate::shutdown::Shutdown;
use crate::tls::certs::{CertSlot, Origin};
use crate::tls::Shared;
use store::CertFacts;

/// The longest one issuance may take, from the first request to the stored file.
const ORDER_TIMEOUT: Duration = Duration::from_secs(180);
/// How long an ARI (renewal information) request may take.
const ARI_TIMEOUT: Duration = Duration::from_secs(15);
/// The longest pause between two passes (due times are wall-clock times, which a
/// clock step or a suspend can bring nearer than the sleep computed from them).
const MAX_PAUSE: Duration = Duration::from_secs(3600);
/// The shortest pause between two passes: a due time that stays in the past (an
/// order that cannot be placed, a clock step) must not make the manager spin.
const MIN_PAUSE: Duration = Duration::from_secs(1);
/// The first retry after a failure; doubled per failure up to [`BACKOFF_MAX`].
const BACKOFF_BASE: Duration = Duration::from_secs(60);
const BACKOFF_MAX: Duration = Duration::from_secs(6 * 3600);
/// The shortest pause between an issuance and the next order of the same
/// certificate, whatever its dates or the ARI window say: a CA that issues
/// certificates already due (or a clock ahead) must not get an order per pass.
const SUCCESS_GAP: Duration = Duration::from_secs(10 * 60);
/// Restarts of a panicked manager allowed per hour; more wait for the hour's end.
const MAX_RESTARTS_PER_HOUR: usize = 10;
/// The pause before a panicked manager is started again.
const RESTART_PAUSE: Duration = Duration::from_secs(5);
/// ARI is asked again at least this often, at most as often as its `Retry-After`.
const ARI_RECHECK_MIN: Duration = Duration::from_secs(60);
const ARI_RECHECK_MAX: Duration = Duration::from_secs(24 * 3600);
/// Forced renewals waiting at once (`webship certs --renew`); more are refused.
const MAX_FORCED: usize = 64;

/// Why an issuance failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AcmeError {
    #[error("ACME request failed ({step}): {source} (fix: check that the directory URL is reachable and the server accepts this account)")]
    Client {
        step: &'static str,
        #[source]
        source: instant_acme::Error,
    },
    #[error("the ACME server refused: {0} (fix: check that the server reaches this daemon's TLS port for the site's name)")]
    Refused(String),
    #[error("certificate: {0}")]
    Certificate(String),
    #[error("cannot write `{path}`: {source} (fix: make `[acme] storage` writable by the daemon's account)")]
    Storage {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the order took longer than {}s", ORDER_TIMEOUT.as_secs())]
    Timeout,
}

/// Where a forced renewal's outcome goes: the new serial, or the error.
type Outcome = oneshot::Sender<Result<String, String>>;

/// What the manager knows of one certificate (one [`AcmeSource`]).
#[derive(Debug, Default)]
struct Status {
    facts: Option<CertFacts>,
    /// When the next order is due (`None`: now).
    next: Option<SystemTime>,
    ari_recheck: Option<SystemTime>,
    /// When this manager last installed a certificate for it.
    issued_at: Option<SystemTime>,
    failures: u32,
    last_error: Option<String>,
    /// Callers of a forced renewal, told the outcome.
    waiting: Vec<Outcome>,
}

impl Status {
    /// When the manager next has something to do for this source: its order, and its
    /// ARI recheck while a certificate is `served`. Only a served certificate's
    /// schedule refreshes the recheck, so one kept for an emptied slot would stay in
    /// the past and be due at every pass.
    fn due(&self, served: bool) -> Option<SystemTime> {
        let recheck = self.ari_recheck.filter(|_| served);
        [self.next, recheck].into_iter().flatten().min()
    }
}

/// The pause before the next pass, due at `next` (`None`: nothing is): until then,
/// within [`MIN_PAUSE`]..[`MAX_PAUSE`].
fn pause_until(next: Option<SystemTime>, now: SystemTime) -> Duration {
    next.map_or(MAX_PAUSE, |t| t.duration_since(now).unwrap_or_default())
        .clamp(MIN_PAUSE, MAX_PAUSE)
}

/// The ACME manager: one per process, shared by the supervisor (for `webship
/// certs`) and its own task.
#[derive(Debug)]
pub(crate) struct Manager {
    tls: Arc<Shared>,
    status: Mutex<HashMap<AcmeSource, Status>>,
    /// Site names whose renewal was asked for.
    forced: Mutex<Vec<(String, Outcome)>>,
    wake: Notify,
    /// Pending http-01 answers, served by the `[acme] http_listen` listener.
    http01: Arc<http01::Tokens>,
    issued: AtomicU64,
    failed: AtomicU64,
}

impl Manager {
    pub(crate) fn new(tls: Arc<Shared>) -> Arc<Self> {
        Arc::new(Self {
            tls,
            status: Mutex::default(),
            forced: Mutex::default(),
            wake: Notify::new(),
            http01: Arc::default(),
            issued: AtomicU64::new(0),
            failed: AtomicU64::new(0),
        })
    }

    /// Renews `site`'s certificate now; the receiver gets the new serial or the
    /// error. `None` when no ACME site has that name (or too many are waiting).
    pub(crate) fn force(&self, site: &str) -> Option<oneshot::Receiver<Result<String, String>>> {
        let known = self.tls.certs.acme_slots().iter().any(|(k, _)| k.site == site);
        let mut forced = self.forced.lock().unwrap_or_else(|p| p.into_inner());
        if !known || forced.len() >= MAX_FORCED {
            return None;
        }
        let (tx, rx) = oneshot::channel();
        forced.push((site.to_owned(), tx));
        drop(forced);
        self.wake.notify_one();
        Some(rx)
    }

    /// The http-01 answers, for the plain-HTTP listener.
    pub(crate) fn http01_tokens(&self) -> Arc<http01::Tokens> {
        self.http01.clone()
    }

    /// Every ACME site's certificate, by site name.
    pub(crate) fn list(&self) -> Vec<CertInfo> {
        let epoch = |t: SystemTime| {
            t.duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs())
        };
        let status = self.status.lock().unwrap_or_else(|p| p.into_inner());
        let mut list: Vec<CertInfo> = self
            .tls
            .certs
            .acme_slots()
            .into_iter()
            .filter_map(|(key, slot)| {
                let Origin::Acme(source) = key.origin else {
                    return None;
                };
                let st = status.get(&source);
                let facts = slot_facts(&slot).or_else(|| st.and_then(|s| s.facts.clone()));
                Some(CertInfo {
                    site: key.site,
                    source: "acme".into(),
                    directory: Some(source.directory.clone()),
                    serial: slot.get().and(facts.as_ref().map(|f| f.serial.clone())),
                    not_after: facts.map(|f| epoch(f.not_after)),
                    next_renewal: st.and_then(|s| s.next).map(epoch),
                    last_error: st.and_then(|s| s.last_error.clone()),
                })
            })
            .collect();
        list.sort_by(|a, b| a.site.cmp(&b.site));
        list
    }

    /// Keeps the ACME slots filled until shutdown. Each pass orders what is due, one
    /// certificate at a time, each bounded by [`ORDER_TIMEOUT`]; between passes the
    /// manager sleeps until the next due time, a reload or a forced renewal.
    pub(crate) async fn run(self: Arc<Self>, mut shutdown: Shutdown) {
        let mut accounts: HashMap<std::path::PathBuf, Account> = HashMap::new();
        let mut table = self.tls.certs.changes();
        while !shutdown.is_requested() {
            // Marked seen before the pass: a reload during it wakes the sleep below.
            table.borrow_and_update();
            let next = self.pass(&mut accounts).await;
            tokio::select! {
                _ = tokio::time::sleep(pause_until(next, SystemTime::now())) => {}
                _ = self.wake.notified() => {}
                () = crate::tls::certs::changed(&mut table) => {}
                _ = shutdown.requested() => {}
            }
        }
    }

    /// One walk over the table; returns the earliest order or ARI recheck due.
    async fn pass(&self, accounts: &mut HashMap<std::path::PathBuf, Account>) -> Option<SystemTime> {
        let mut sources: HashMap<AcmeSource, Vec<(String, Arc<CertSlot>)>> = HashMap::new();
        for (key, slot) in self.tls.certs.acme_slots() {
            if let Origin::Acme(source) = key.origin {
                sources.entry(source).or_default().push((key.site, slot));
            }
        }
        let forced: Vec<_> = std::mem::take(&mut *self.forced.lock().unwrap_or_else(|p| p.into_inner()));
        {
            // Forget what no slot names any more: the table stays as large as the config.
            let mut status = self.status.lock().unwrap_or_else(|p| p.into_inner());
            status.retain(|s, _| sources.contains_key(s));
            for (site, tx) in forced {
                match sources
                    .iter()
                    .find(|(_, slots)| slots.iter().any(|(name, _)| *name == site))
                {
                    Some((source, _)) => {
                        let st = status.entry(source.clone()).or_default();
                        st.next = None;
                        st.waiting.push(tx);
                    }
                    None => {
                        let _ = tx.send(Err(format!("no ACME site `{site}`")));
                    }
                }
            }
        }
        let mut earliest: Option<SystemTime> = None;
        for (source, slots) in &sources {
            if self.due(source, slots, accounts).await {
                self.renew(source, slots, accounts).await;
            }
            let served = slots.iter().any(|(_, slot)| slot.get().is_some());
            let status = self.status.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(due) = status.get(source).and_then(|s| s.due(served)) {
                earliest = Some(earliest.map_or(due, |e| e.min(due)));
            }
        }
        earliest
    }

    /// Whether `source` should be ordered now; schedules it when first seen with a
    /// certificate (stored or from before a reload).
    async fn due(
        &self,
        source: &AcmeSource,
        slots: &[(String, Arc<CertSlot>)],
        accounts: &mut HashMap<std::path::PathBuf, Account>,
    ) -> bool {
        let now = SystemTime::now();
        let served = slots.iter().find_map(|(_, s)| s.get());
        let (scheduled, ari_due) = {
            let mut status = self.status.lock().unwrap_or_else(|p| p.into_inner());
            let st = status.entry(source.clone()).or_default();
            if !st.waiting.is_empty() {
                return true;
            }
            if served.is_none() {
                return st.next.is_none_or(|t| t <= now);
            }
            (st.next.is_some(), st.ari_recheck.is_none_or(|t| t <= now))
        };
        if !scheduled || ari_due {
            let leaf = served.as_ref().and_then(|k| k.cert.first().cloned());
            if let Some(leaf) = leaf {
                self.schedule(source, &leaf, accounts).await;
            }
        }
        let status = self.status.lock().unwrap_or_else(|p| p.into_inner());
        status.get(source).and_then(|s| s.next).is_none_or(|t| t <= now)
    }

    /// Sets when the served certificate `leaf` is renewed: ARI's window when the
    /// server offers it, else when a third of its lifetime is left, less jitter.
    async fn schedule(
        &self,
        source: &AcmeSource,
        leaf: &rustls::pki_types::CertificateDer<'static>,
        accounts: &mut HashMap<std::path::PathBuf, Account>,
    ) {
        let Ok(facts) = CertFacts::of(leaf) else { return };
        let now = SystemTime::now();
        let mut recheck = now + ARI_RECHECK_MAX;
        let mut window = None;
        if let Ok(id) = CertificateIdentifier::try_from(leaf) {
            if let Some(account) = account_for(source, accounts).await {
                match tokio::time::timeout(ARI_TIMEOUT, account.renewal_info(&id)).await {
                    Ok(Ok((info, retry))) => {
                        let suggested = &info.suggested_window;
                        window = Some((SystemTime::from(suggested.start), SystemTime::from(suggested.end)));
                        recheck = now + retry.clamp(ARI_RECHECK_MIN, ARI_RECHECK_MAX);
                    }
                    Ok(Err(instant_acme::Error::Unsupported(_))) => {}
                    Ok(Err(e)) => tracing::debug!(error = %e, "acme: renewal information unavailable"),
                    Err(_) => tracing::debug!("acme: renewal information timed out"),
                }
            }
        }
        let share = self.random_share();
        let mut status = self.status.lock().unwrap_or_else(|p| p.into_inner());
        let st = status.entry(source.clone()).or_default();
        // A failure's backoff stands until the next attempt.
        if st.failures == 0 {
            st.next = Some(renewal_time(&facts, window, share, st.issued_at));
        }
        st.facts = Some(facts);
        st.ari_recheck = Some(recheck);
    }

    /// Orders `source`'s certificate and swaps it into every slot that serves it.
    async fn renew(
        &self,
        source: &AcmeSource,
        slots: &[(String, Arc<CertSlot>)],
        accounts: &mut HashMap<std::path::PathBuf, Account>,
    ) {
        let sites: Vec<&str> = slots.iter().map(|(s, _)| s.as_str()).collect();
        let renewing = slots.iter().any(|(_, s)| s.get().is_some());
        tracing::info!(sites = ?sites, directory = %source.directory, renewing, "acme: ordering a certificate");
        let started = std::time::Instant::now();
        let outcome = match tokio::time::timeout(ORDER_TIMEOUT, self.order(source, accounts)).await {
            Ok(outcome) => outcome,
            Err(_) => Err(AcmeError::Timeout),
        };
        let result = self.record(source, slots, outcome, started, accounts);
        if let Some(leaf) = result
            .is_ok()
            .then(|| slots.iter().find_map(|(_, s)| s.get()))
            .flatten()
        {
            if let Some(leaf) = leaf.cert.first() {
                self.schedule(source, leaf, accounts).await;
            }
        }
        let waiting = {
            let mut status = self.status.lock().unwrap_or_else(|p| p.into_inner());
            status
                .get_mut(source)
                .map(|st| std::mem::take(&mut st.waiting))
                .unwrap_or_default()
        };
        for tx in waiting {
            let _ = tx.send(result.clone());
        }
    }

    /// Installs an order's certificate, or records its failure and the backoff.
    fn record(
        &self,
        source: &AcmeSource,
        slots: &[(String, Arc<CertSlot>)],
        outcome: Result<order::Issued, AcmeError>,
        started: std::time::Instant,
        accounts: &mut HashMap<std::path::PathBuf, Account>,
    ) -> Result<String, String> {
        let sites: Vec<&str> = slots.iter().map(|(s, _)| s.as_str()).collect();
        let mut status = self.status.lock().unwrap_or_else(|p| p.into_inner());
        let st = status.entry(source.clone()).or_default();
        match outcome {
            Ok(issued) => {
                let key = Arc::new(issued.key);
                for (_, slot) in slots {
                    slot.set(key.clone());
                }
                self.issued.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    sites = ?sites,
                    serial = %issued.facts.serial,
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "acme: certificate installed"
                );
                let serial = issued.facts.serial.clone();
                st.facts = Some(issued.facts);
                st.failures = 0;
                st.last_error = None;
                // Until `schedule` reads the new certificate; whatever it finds, no
                // order follows sooner than this.
                let now = SystemTime::now();
                st.issued_at = Some(now);
                st.next = Some(now + SUCCESS_GAP);
                st.ari_recheck = None;
                Ok(serial)
            }
            Err(e) => {
                // A server that forgot the account (a test CA restarted, an account
                // deactivated) gets a new one at the next attempt.
                accounts.remove(&store::account_file(source));
                if forgotten_account(&e) {
                    let _ = std::fs::remove_file(store::account_file(source));
                }
                self.failed.fetch_add(1, Ordering::Relaxed);
                st.failures = st.failures.saturating_add(1);
                let now = SystemTime::now();
                let next = retry_time(
                    now,
                    st.failures,
                    self.random_share(),
                    retry_after(&e),
                    st.facts.as_ref().map(|f| f.not_after),
                );
                let backoff = next.duration_since(now).unwrap_or_default();
                st.next = Some(next);
                st.last_error = Some(e.to_string());
                tracing::warn!(
                    sites = ?sites,
                    error = %e,
                    retry_in_secs = backoff.as_secs(),
                    "acme: could not obtain a certificate; the current one (if any) stays in service"
                );
                Err(e.to_string())
            }
        }
    }

    async fn order(
        &self,
        source: &AcmeSource,
        accounts: &mut HashMap<std::path::PathBuf, Account>,
    ) -> Result<order::Issued, AcmeError> {
        let account = match account_for(source, accounts).await {
            Some(account) => account,
            None => {
                let account = order::account(source).await?;
                accounts.insert(store::account_file(source), account.clone());
                account
            }
        };
        order::obtain(
            &account,
            source,
            &self.tls.challenges,
            &self.http01,
            &self.tls.provider,
        )
        .await
    }

    /// A uniformly random number in [0, 1).
    fn random_share(&self) -> f64 {
        let mut bytes = [0u8; 8];
        if self.tls.provider.secure_random.fill(&mut bytes).is_err() {
            return 0.5;
        }
        (u64::from_le_bytes(bytes) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The account for `source`, from the cache or restored from storage (`None` when
/// there is none yet, or it cannot be restored now).
async fn account_for(
    source: &AcmeSource,
    accounts: &mut HashMap<std::path::PathBuf, Account>,
) -> Option<Account> {
    let file = store::account_file(source);
    if let Some(account) = accounts.get(&file) {
        return Some(account.clone());
    }
    if !file.exists() {
        return None;
    }
    let account = tokio::time::timeout(ARI_TIMEOUT, order::account(source))
        .await
        .ok()?
        .ok()?;
    accounts.insert(file, account.clone());
    Some(account)
}

/// Runs the manager until shutdown and starts it again when it panics (a bug, or a
/// library that panics on a server's answer): renewals must not stop silently for
/// the rest of the process's life. At most [`MAX_RESTARTS_PER_HOUR`] restarts an
/// hour; more wait until the oldest is an hour old.
pub(crate) async fn supervise(manager: Arc<Manager>, shutdown: Shutdown) {
    let run_shutdown = shutdown.clone();
    supervised(
        move || manager.clone().run(run_shutdown.clone()),
        shutdown,
        RESTART_PAUSE,
    )
    .await;
}

/// Aborts the supervised task when the supervisor is itself aborted (at the end
/// of `server::run`), so no manager outlives it.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn supervised<F, Fut>(start: F, mut shutdown: Shutdown, pause: Duration)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    const HOUR: Duration = Duration::from_secs(3600);
    let mut restarts: std::collections::VecDeque<std::time::Instant> = std::collections::VecDeque::new();
    loop {
        let mut task = tokio::spawn(start());
        let _guard = AbortOnDrop(task.abort_handle());
        let reason = match (&mut task).await {
            Ok(()) => return,
            Err(e) if !e.is_panic() => return,
            Err(e) => {
                let payload = e.into_panic();
                payload
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".to_owned())
            }
        };
        if shutdown.is_requested() {
            return;
        }
        let now = std::time::Instant::now();
        while restarts.front().is_some_and(|t| now.duration_since(*t) >= HOUR) {
            restarts.pop_front();
        }
        let wait = match restarts.front() {
            Some(oldest) if restarts.len() >= MAX_RESTARTS_PER_HOUR => {
                (*oldest + HOUR).saturating_duration_since(now).max(pause)
            }
            _ => pause,
        };
        tracing::error!(
            reason = %reason,
            restart_in_secs = wait.as_secs(),
            "acme: the certificate manager stopped unexpectedly; restarting"
        );
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.requested() => return,
        }
        restarts.push_back(std::time::Instant::now());
    }
}

/// When a served certificate (`facts`) is renewed: at `share` (uniform in [0, 1))
/// of the ARI `window` when the server offers one, else when a third of its
/// lifetime is left less up to a twentieth; never later than a tenth of its
/// lifetime before expiry (an ARI window past it is the server's mistake), and
/// never sooner than [`SUCCESS_GAP`] after the last issuance (`issued_at`).
fn renewal_time(
    facts: &CertFacts,
    window: Option<(SystemTime, SystemTime)>,
    share: f64,
    issued_at: Option<SystemTime>,
) -> SystemTime {
    let lifetime = facts.lifetime();
    let latest = facts
        .not_after
        .checked_sub(lifetime / 10)
        .unwrap_or(facts.not_before);
    let next = match window {
        Some((start, end)) => {
            let span = end.duration_since(start).unwrap_or_default();
            start.checked_add(span.mul_f64(share)).unwrap_or(start)
        }
        None => facts
            .not_after
            .checked_sub(lifetime / 3 + lifetime.mul_f64(share / 20.0))
            .unwrap_or(facts.not_before),
    };
    let next = next.min(latest);
    match issued_at.and_then(|t| t.checked_add(SUCCESS_GAP)) {
        Some(earliest) => next.max(earliest),
        None => next,
    }
}

/// When a failed order is tried again: after [`BACKOFF_BASE`] doubled per
/// consecutive failure (plus up to a tenth, `share` in [0, 1)) up to
/// [`BACKOFF_MAX`]; the server's `Retry-After` is a floor but clamped to the same
/// maximum, so a server cannot stop retries for longer. When the served
/// certificate ends (`not_after`) sooner, the retry comes a [`BACKOFF_BASE`] before
/// its end rather than after it, though never sooner than a [`BACKOFF_BASE`] from now.
fn retry_time(
    now: SystemTime,
    failures: u32,
    share: f64,
    retry_after: Option<Duration>,
    not_after: Option<SystemTime>,
) -> SystemTime {
    let shift = failures.saturating_sub(1).min(16);
    let backoff = BACKOFF_BASE.saturating_mul(1 << shift).min(BACKOFF_MAX);
    let backoff = backoff + backoff.mul_f64(share.clamp(0.0, 1.0) / 10.0);
    let backoff = backoff.max(retry_after.unwrap_or_default().min(BACKOFF_MAX));
    let at = now + backoff;
    match not_after.and_then(|t| t.checked_sub(BACKOFF_BASE)) {
        Some(before_end) => at.min(before_end.max(now + BACKOFF_BASE)),
        None => at,
    }
}

/// How long the server asked to wait (`Retry-After` while polling an order).
fn retry_after(e: &AcmeError) -> Option<Duration> {
    match e {
        AcmeError::Client {
            source: instant_acme::Error::Timeout(Some(at)),
            ..
        } => Some(at.saturating_duration_since(std::time::Instant::now())),
        _ => None,
    }
}

fn forgotten_account(e: &AcmeError) -> bool {
    matches!(e, AcmeError::Client { source: instant_acme::Error::Api(p), .. }
        if p.r#type.as_deref().is_some_and(|t| t.ends_with(":accountDoesNotExist")))
}

fn slot_facts(slot: &CertSlot) -> Option<CertFacts> {
    CertFacts::of(slot.get()?.cert.first()?).ok()
}

/// Creates every ACME storage folder of `config` (0700) and, when the daemon
/// switches to a service account, hands it the folder and what is in it, so the
/// manager (which runs as that account) can write there. Links are not followed,
/// even one the account swaps in during the walk, and what the account could have
/// planted is left alone (`fsutil::give_tree_nofollow`).
pub(crate) fn prepare_storage(config: &crate::config::Config, ids: Option<(u32, u32)>) {
    let mut folders: Vec<&std::path::Path> = config
        .sites
        .iter()
        .filter_map(|s| match &s.tls {
            crate::config::TlsSource::Acme(a) => Some(a.storage.as_path()),
            _ => None,
        })
        .collect();
    folders.sort();
    folders.dedup();
    for folder in folders {
        let result = store::create_private_dir(folder).and_then(|()| match ids {
            Some((uid, gid)) => crate::fsutil::give_tree_nofollow(folder, uid, gid, STORAGE_LEVELS),
            None => Ok(()),
        });
        if let Err(e) = result {
            tracing::warn!(path = %folder.display(), error = %e, "acme: cannot prepare the storage folder; certificates cannot be stored");
        }
    }
}

/// How deep the handover walks: the deepest files, `certs/<names>-<tag>/key.pem`,
/// are three levels below the storage folder.
const STORAGE_LEVELS: usize = 3;

/// `webship_acme_*`: orders that succeeded and failed since start.
#[derive(Debug)]
pub(crate) struct Metrics(pub(crate) Arc<Manager>);

impl Collector for Metrics {
    fn collect(&self, out: &mut Encoder) {
        out.family(
            "webship_acme_orders",
            Kind::Counter,
            "ACME certificate orders since start, by outcome (issued: installed; failed: the old certificate, if any, kept serving)",
        )
        .sample(&[("outcome", "issued")], self.0.issued.load(Ordering::Relaxed))
        .sample(&[("outcome", "failed")], self.0.failed.load(Ordering::Relaxed));
        out.family(
            "webship_acme_http01_refused_connections",
            Kind::Counter,
            "Connections the http-01 listener closed at accept: their address held 8 already, or the listener 256",
        )
        .sample(&[], http01::REFUSED.load(Ordering::Relaxed));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(86_400);

    fn facts(not_before: SystemTime, not_after: SystemTime) -> CertFacts {
        CertFacts {
            serial: "01".into(),
            not_before,
            not_after,
        }
    }

    /// An ARI recheck counts only while a certificate is served: a past one left by
    /// an emptied slot does not make the source due.
    #[test]
    fn an_ari_recheck_counts_only_while_a_certificate_is_served() {
        let now = SystemTime::UNIX_EPOCH + 1000 * DAY;
        let st = |next, ari_recheck| Status {
            next,
            ari_recheck,
            ..Status::default()
        };
        let past = now - DAY;
        assert_eq!(st(Some(now + DAY), Some(past)).due(true), Some(past));
        assert_eq!(st(Some(now + DAY), Some(past)).due(false), Some(now + DAY));
        assert_eq!(st(None, Some(past)).due(false), None);
        assert_eq!(st(Some(now), Some(now + DAY)).due(true), Some(now));
        assert_eq!(st(None, None).due(true), None);
    }

    /// A past due time pauses a second, not zero; a far or no due time an hour.
    #[test]
    fn the_pause_is_between_a_second_and_an_hour() {
        let now = SystemTime::UNIX_EPOCH + 1000 * DAY;
        assert_eq!(pause_until(Some(now - DAY), now), MIN_PAUSE);
        assert_eq!(pause_until(Some(now), now), MIN_PAUSE);
        assert_eq!(
            pause_until(Some(now + Duration::from_secs(30)), now),
            Duration::from_secs(30)
        );
        assert_eq!(pause_until(Some(now + DAY), now), MAX_PAUSE);
        assert_eq!(pause_until(None, now), MAX_PAUSE);
    }

    #[test]
    fn renewal_without_ari_is_at_two_thirds_less_jitter() {
        let start = SystemTime::UNIX_EPOCH + 1000 * DAY;
        let f = facts(start, start + 90 * DAY);
        assert_eq!(renewal_time(&f, None, 0.0, None), start + 60 * DAY);
        let late = renewal_time(&f, None, 0.999, None);
        assert!(late < start + 60 * DAY && late > start + 55 * DAY, "{late:?}");
    }

    #[test]
    fn ari_window_past_expiry_is_clamped_to_a_tenth_before_it() {
        let start = SystemTime::UNIX_EPOCH + 1000 * DAY;
        let f = facts(start, start + 90 * DAY);
        let far = (start + 3650 * DAY, start + 3651 * DAY);
        assert_eq!(renewal_time(&f, Some(far), 0.5, None), start + 81 * DAY);
        let inside = (start + 10 * DAY, start + 12 * DAY);
        assert_eq!(renewal_time(&f, Some(inside), 0.5, None), start + 11 * DAY);
    }

    #[test]
    fn a_certificate_issued_already_due_waits_the_success_gap() {
        // Issued with a week left of 90 days: due at once by its dates, and an ARI
        // window in the past says the same; the next order still waits.
        let now = SystemTime::UNIX_EPOCH + 2000 * DAY;
        let f = facts(now - 83 * DAY, now + 7 * DAY);
        let past = (now - 2 * DAY, now - DAY);
        for window in [None, Some(past)] {
            assert_eq!(renewal_time(&f, window, 0.3, Some(now)), now + SUCCESS_GAP);
        }
    }

    #[test]
    fn retry_after_is_clamped_to_the_backoff_maximum() {
        let now = SystemTime::UNIX_EPOCH + 2000 * DAY;
        let ten_years = Some(3650 * DAY);
        assert_eq!(retry_time(now, 1, 0.0, ten_years, None), now + BACKOFF_MAX);
        assert_eq!(
            retry_time(now, 1, 0.0, Some(Duration::MAX), None),
            now + BACKOFF_MAX
        );
        // A short one is a floor above the first backoff.
        assert_eq!(
            retry_time(now, 1, 0.0, Some(Duration::from_secs(600)), None),
            now + Duration::from_secs(600)
        );
    }

    #[test]
    fn backoff_doubles_to_the_maximum() {
        let now = SystemTime::UNIX_EPOCH + 2000 * DAY;
        assert_eq!(retry_time(now, 1, 0.0, None, None), now + BACKOFF_BASE);
        assert_eq!(retry_time(now, 3, 0.0, None, None), now + 4 * BACKOFF_BASE);
        assert_eq!(retry_time(now, 1000, 0.0, None, None), now + BACKOFF_MAX);
        let jittered = retry_time(now, 1000, 0.999, None, None);
        assert!(jittered <= now + BACKOFF_MAX + BACKOFF_MAX / 10);
    }

    #[test]
    fn a_retry_comes_before_the_served_certificate_ends() {
        let now = SystemTime::UNIX_EPOCH + 2000 * DAY;
        let ends = now + Duration::from_secs(3600);
        let at = retry_time(now, 20, 0.0, Some(3650 * DAY), Some(ends));
        assert_eq!(at, ends - BACKOFF_BASE);
        // Already (almost) expired: not sooner than the base backoff.
        let at = retry_time(now, 20, 0.0, None, Some(now));
        assert_eq!(at, now + BACKOFF_BASE);
    }

    #[tokio::test]
    async fn a_panicking_manager_is_restarted() {
        let (_trigger, shutdown) = crate::shutdown::channel();
        let runs = Arc::new(AtomicU64::new(0));
        let counted = runs.clone();
        let start = move || {
            let counted = counted.clone();
            async move {
                if counted.fetch_add(1, Ordering::SeqCst) < 2 {
                    panic!("test panic");
                }
            }
        };
        tokio::time::timeout(
            Duration::from_secs(10),
            supervised(start, shutdown, Duration::from_millis(1)),
        )
        .await
        .expect("the supervisor returns once the manager ends normally");
        assert_eq!(runs.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn shutdown_ends_the_supervisor_during_its_pause() {
        let (trigger, shutdown) = crate::shutdown::channel();
        let start = || async { panic!("test panic") };
        let supervisor = tokio::spawn(supervised(start, shutdown, Duration::from_secs(3600)));
        tokio::time::sleep(Duration::from_millis(50)).await;
        trigger.request();
        tokio::time::timeout(Duration::from_secs(10), supervisor)
            .await
            .expect("the supervisor ends at shutdown")
            .expect("the supervisor itself does not panic");
    }
}
