//! OCSP stapling: each certificate whose leaf names an OCSP responder (Authority
//! Information Access) gets the responder's signed answer attached to its
//! handshakes, so clients need not ask the responder themselves.
//!
//! One task per certificate slot, started by [`run`], which walks the certificate
//! table each time a reload installs one (a reload that adds or removes a site, a
//! renewal by file or ACME, needs nothing from here). A task sleeps until its next
//! fetch or its staple's expiry (at most a minute while it holds a staple, since a
//! suspend or a clock step can bring the expiry nearer), and wakes early when its
//! slot takes a new leaf or its stapling setting changes ([`CertSlot::changes`]), or
//! its slot leaves the table. A task asks the responder ([`fetch`]), verifies the answer ([`check`]), staples it through
//! [`CertSlot::staple`] and writes it to the cache folder, from which a restart
//! staples at once. It asks again half-way to the answer's `nextUpdate`, sooner after
//! a failure (with backoff), keeps a still-valid staple through failures and drops one
//! whose `nextUpdate` has passed (handshakes already leave such a staple out). A `revoked` answer is logged as an error and never
//! stapled.

mod check;
mod fetch;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use rustls::pki_types::CertificateDer;

use super::certs::{changed, CertSlot, SlotKey, StapleState};
use super::Shared;
use crate::metrics::{Collector, Encoder, Kind};
use check::{Answer, Status, Target};

/// The longest a task sleeps without looking at its slot (shorter while it holds a
/// staple: [`STAPLE_SLEEP`]).
const MAX_SLEEP: Duration = Duration::from_secs(3600);
/// The longest a task holding a staple sleeps. The sleep runs on the monotonic
/// clock, which stops while the host is suspended, and a forward clock step does
/// not shorten it: after either, a staple whose `nextUpdate` passed would be served
/// until a long sleep ends. Handshakes leave such a staple out themselves
/// ([`CertSlot::serve`]); looking once a minute takes it off the slot and asks the
/// responder again within a minute.
const STAPLE_SLEEP: Duration = Duration::from_secs(60);
/// The first retry after a failed fetch; doubled each time up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_secs(5);
const MAX_BACKOFF: Duration = Duration::from_secs(3600);
/// Bounds on the wait before a refresh, whatever `nextUpdate` says.
const MIN_REFRESH: Duration = Duration::from_secs(10);
const MAX_REFRESH: Duration = Duration::from_secs(7 * 24 * 3600);
/// The refresh of an answer without `nextUpdate` (newer information is always
/// available, RFC 6960 4.2.2.1).
const NO_NEXT_UPDATE_REFRESH: Duration = Duration::from_secs(3600);

static GOOD: AtomicU64 = AtomicU64::new(0);
static REVOKED: AtomicU64 = AtomicU64::new(0);
static FETCH_ERRORS: AtomicU64 = AtomicU64::new(0);

/// Starts and ends the slots' tasks as the certificate table changes; runs until
/// dropped (aborting it leaves the tasks to end with their slots).
pub(crate) async fn run(shared: Arc<Shared>, cache: PathBuf) {
    let mut tasks = Tasks::default();
    let mut table = shared.certs.changes();
    loop {
        table.borrow_and_update();
        for (key, slot) in tasks.unstaffed(shared.certs.snapshot()) {
            let task = Stapler::new(shared.clone(), key.clone(), slot.clone(), cache.clone());
            tasks.0.insert(
                key,
                Task {
                    slot,
                    handle: tokio::spawn(task.run()),
                },
            );
        }
        changed(&mut table).await;
    }
}

/// A slot's task, with the slot it staples: a key can name a new slot while the
/// task for its old one is still ending.
struct Task {
    slot: Arc<CertSlot>,
    handle: tokio::task::JoinHandle<()>,
}

/// The slots' tasks, ended with the manager (aborting [`run`] at shutdown stops
/// every fetch).
#[derive(Default)]
struct Tasks(HashMap<SlotKey, Task>);

impl Tasks {
    /// Keeps the tasks still running for a slot `table` holds under their key, ends
    /// the rest, and returns the slots left without a task. A stapler notices that
    /// its slot left only once its step ends (a fetch can take seconds), so a site
    /// removed and restored meanwhile finds its old task under its key: that task
    /// is for the old slot, and the new one needs its own.
    fn unstaffed(&mut self, table: Vec<(SlotKey, Arc<CertSlot>)>) -> Vec<(SlotKey, Arc<CertSlot>)> {
        let table: HashMap<SlotKey, Arc<CertSlot>> = table.into_iter().collect();
        self.0.retain(|key, task| {
            let keep = !task.handle.is_finished()
                && table.get(key).is_some_and(|slot| Arc::ptr_eq(slot, &task.slot));
            if !keep {
                task.handle.abort();
            }
            keep
        });
        table
            .into_iter()
            .filter(|(key, _)| !self.0.contains_key(key))
            .collect()
    }
}

impl Drop for Tasks {
    fn drop(&mut self) {
        for task in self.0.values() {
            task.handle.abort();
        }
    }
}

/// Makes the cache folder and hands it to the service account, while the daemon can
/// (as root, before the switch), when some certificate will be stapled.
pub(crate) fn prepare_cache(shared: &Shared, cache: &Path, owner: Option<(u32, u32)>) {
    let wanted = shared.certs.snapshot().iter().any(|(_, slot)| {
        slot.stapling()
            && slot
                .get()
                .is_some_and(|c| matches!(check::target(&c.cert), Ok(Some(_))))
    });
    if !wanted {
        return;
    }
    // The folder above may belong to the service account, which could plant a
    // symlink here for root to chown its target: a symlink is refused, and the chown
    // goes through a descriptor that is not opened through one.
    if std::fs::symlink_metadata(cache).is_ok_and(|m| m.file_type().is_symlink()) {
        tracing::warn!(dir = %cache.display(), "the OCSP cache folder is a symlink and is left as it is, not handed to the service account (fix: make `ocsp_cache` a real folder)");
        return;
    }
    let made = std::fs::create_dir_all(cache).and_then(|()| match owner {
        Some((uid, gid)) => crate::fsutil::chown_dir_nofollow(cache, uid, gid),
        None => Ok(()),
    });
    if let Err(e) = made {
        tracing::warn!(dir = %cache.display(), error = %e, "cannot prepare the OCSP cache folder: responses are stapled but not kept across restarts");
    }
}

/// One slot's stapling.
struct Stapler {
    shared: Arc<Shared>,
    key: SlotKey,
    slot: Arc<CertSlot>,
    cache: PathBuf,
    /// The leaf the state below is for.
    leaf: Option<CertificateDer<'static>>,
    /// `None`: the leaf names no responder, or cannot be asked about.
    target: Option<Target>,
    next_fetch: Instant,
    backoff: Duration,
    /// When the stapled answer stops being valid (`nextUpdate`).
    staple_expires: Option<SystemTime>,
    stapling: bool,
}

impl Stapler {
    fn new(shared: Arc<Shared>, key: SlotKey, slot: Arc<CertSlot>, cache: PathBuf) -> Self {
        Self {
            shared,
            key,
            slot,
            cache,
            leaf: None,
            target: None,
            next_fetch: Instant::now(),
            backoff: MIN_BACKOFF,
            staple_expires: None,
            stapling: false,
        }
    }

    async fn run(mut self) {
        let (mut slot, mut table) = (self.slot.changes(), self.shared.certs.changes());
        while self.shared.certs.holds(&self.key, &self.slot) {
            // Marked seen before the step: a change during it wakes the sleep below.
            slot.borrow_and_update();
            table.borrow_and_update();
            self.step().await;
            tokio::select! {
                () = tokio::time::sleep(self.until_due()) => {}
                () = changed(&mut slot) => {}
                () = changed(&mut table) => {}
            }
        }
    }

    /// How long until [`Stapler::step`] has something to do without a change to the
    /// slot: the next fetch, or the staple's expiry.
    fn until_due(&self) -> Duration {
        if !self.stapling || self.target.is_none() {
            return MAX_SLEEP;
        }
        sleep_for(
            self.next_fetch.saturating_duration_since(Instant::now()),
            self.staple_expires,
            SystemTime::now(),
        )
    }

    async fn step(&mut self) {
        let Some(current) = self.slot.get() else {
            return;
        };
        let stapling = self.slot.stapling();
        let leaf = &current.cert[0];
        if self.leaf.as_ref() != Some(leaf) || stapling != self.stapling {
            if let Some(old) = self.leaf.as_ref().filter(|old| *old != leaf) {
                // The renewed certificate's predecessor will not be served again.
                remove_cached(self.cache_file(old)).await;
            }
            self.leaf = Some(leaf.clone().into_owned());
            self.stapling = stapling;
            self.start(&current.cert).await;
        }
        if !self.stapling || self.target.is_none() {
            return;
        }
        if self.staple_expires.is_some_and(|t| t <= SystemTime::now()) {
            self.staple_expires = None;
            self.slot.staple(leaf, None, None, StapleState::None);
            tracing::warn!(site = %self.key.site, "OCSP staple expired (nextUpdate passed) before a new answer came: handshakes carry none until the responder answers");
        }
        if Instant::now() >= self.next_fetch {
            self.fetch().await;
        }
    }

    /// A new leaf (or stapling just turned on): what to ask, and the cached answer.
    async fn start(&mut self, chain: &[CertificateDer<'static>]) {
        self.target = None;
        self.staple_expires = None;
        self.backoff = MIN_BACKOFF;
        self.next_fetch = Instant::now();
        if !self.stapling {
            return;
        }
        match check::target(chain) {
            Ok(target) => self.target = target,
            Err(e) => {
                tracing::warn!(site = %self.key.site, error = %e, "OCSP stapling impossible for this certificate; handshakes carry no staple");
                return;
            }
        }
        let Some(target) = &self.target else {
            return;
        };
        let file = self.cache_file(&chain[0]);
        let read = tokio::task::spawn_blocking(move || read_capped(&file)).await;
        let Ok(Some(cached)) = read else {
            return;
        };
        match check::verify(target, &cached, &self.algs(), SystemTime::now()) {
            Ok(answer) if answer.status == Status::Good => {
                tracing::info!(site = %self.key.site, serial = %target.serial, "OCSP response from the cache stapled");
                self.accept(&chain[0], cached, &answer);
            }
            // Stale or otherwise unusable: the responder is asked at once.
            _ => {
                remove_cached(self.cache_file(&chain[0])).await;
            }
        }
    }

    async fn fetch(&mut self) {
        let (Some(target), Some(leaf)) = (self.target.clone(), self.leaf.clone()) else {
            return;
        };
        let answer = match fetch::post(&target.url, &target.request).await {
            Ok(body) => check::verify(&target, &body, &self.algs(), SystemTime::now())
                .map(|answer| (answer, body))
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match answer {
            Ok((answer, body)) if answer.status == Status::Good => {
                // Stapled first: handshakes need not wait for the disk.
                self.accept(&leaf, body.clone(), &answer);
                GOOD.fetch_add(1, Ordering::Relaxed);
                tracing::info!(site = %self.key.site, serial = %target.serial, "OCSP response fetched and stapled");
                self.write_cache(&leaf, body).await;
            }
            Ok((answer, _)) if answer.status == Status::Revoked => {
                REVOKED.fetch_add(1, Ordering::Relaxed);
                tracing::error!(site = %self.key.site, serial = %target.serial, "OCSP: the certificate is REVOKED according to its responder; no staple is sent (replace the certificate)");
                self.staple_expires = None;
                self.slot.staple(&leaf, None, None, StapleState::Revoked);
                remove_cached(self.cache_file(&leaf)).await;
                self.next_fetch = Instant::now() + refresh_after(&answer);
                self.backoff = MIN_BACKOFF;
            }
            Ok(_) => self.failed(
                &target,
                "the responder does not know the certificate (status unknown)",
            ),
            Err(e) => self.failed(&target, &e),
        }
    }

    fn failed(&mut self, target: &Target, error: &str) {
        FETCH_ERRORS.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(site = %self.key.site, serial = %target.serial, error = %error, retry_secs = self.backoff.as_secs(), "OCSP fetch failed; a staple still valid is kept");
        self.next_fetch = Instant::now() + self.backoff;
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
    }

    fn accept(&mut self, leaf: &CertificateDer<'_>, response: Vec<u8>, answer: &Answer) {
        self.slot
            .staple(leaf, Some(response), answer.next_update, StapleState::Good);
        self.staple_expires = answer.next_update;
        self.next_fetch = Instant::now() + refresh_after(answer);
        self.backoff = MIN_BACKOFF;
    }

    fn algs(&self) -> rustls::crypto::WebPkiSupportedAlgorithms {
        self.shared.provider.signature_verification_algorithms
    }

    fn cache_file(&self, leaf: &CertificateDer<'_>) -> PathBuf {
        let digest = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, leaf);
        self.cache.join(format!("{}.der", check::hex(digest.as_ref())))
    }

    /// Writes the answer whole or not at all, off the async workers.
    async fn write_cache(&self, leaf: &CertificateDer<'_>, response: Vec<u8>) {
        let path = self.cache_file(leaf);
        let (cache, file) = (self.cache.clone(), path.clone());
        let written = tokio::task::spawn_blocking(move || {
            std::fs::create_dir_all(&cache)?;
            // Public data (every handshake carries it), like the certificate.
            crate::fsutil::write_atomic(&file, &response, 0o644, None)
        })
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e)));
        if let Err(e) = written {
            tracing::warn!(site = %self.key.site, file = %path.display(), error = %e, "cannot write the OCSP cache; the answer is stapled but a restart will ask again");
        }
    }
}

/// The sleep of a stapler due to fetch in `fetch` whose staple (if any) `expires`:
/// until the fetch or the expiry, never longer than [`MAX_SLEEP`], nor than
/// [`STAPLE_SLEEP`] while a staple is held.
fn sleep_for(fetch: Duration, expires: Option<SystemTime>, now: SystemTime) -> Duration {
    let Some(expires) = expires else {
        return fetch.min(MAX_SLEEP);
    };
    let expiry = expires.duration_since(now).unwrap_or_default();
    fetch.min(expiry).min(STAPLE_SLEEP)
}

/// Half-way from now to `nextUpdate`, within [`MIN_REFRESH`]..[`MAX_REFRESH`].
fn refresh_after(answer: &Answer) -> Duration {
    let Some(next) = answer.next_update else {
        return NO_NEXT_UPDATE_REFRESH;
    };
    let left = next.duration_since(SystemTime::now()).unwrap_or_default();
    (left / 2).clamp(MIN_REFRESH, MAX_REFRESH)
}

/// Forgets a cached answer, off the async workers; one already gone is fine.
async fn remove_cached(path: PathBuf) {
    let _ = tokio::task::spawn_blocking(move || std::fs::remove_file(path)).await;
}

/// A cached response, if the file exists and is no larger than a response may be.
fn read_capped(path: &Path) -> Option<Vec<u8>> {
    let meta = std::fs::metadata(path).ok()?;
    if meta.len() > fetch::MAX_RESPONSE as u64 {
        return None;
    }
    std::fs::read(path).ok()
}

/// The stapling families: each site's staple state, answers and fetch failures.
pub(crate) struct Metrics(pub(crate) Arc<Shared>);

impl Collector for Metrics {
    fn collect(&self, out: &mut Encoder) {
        // One state per site (a reload may briefly hold two slots for one name).
        let states: BTreeMap<String, StapleState> = self
            .0
            .certs
            .snapshot()
            .into_iter()
            .map(|(key, slot)| (key.site, slot.staple_state()))
            .collect();
        out.family(
            "webship_tls_ocsp_staple",
            Kind::Gauge,
            "1 for the OCSP state of each site's certificate: good (a staple is sent), revoked (none is sent), none.",
        );
        for (site, state) in &states {
            for s in StapleState::ALL {
                out.sample(&[("site", site), ("state", s.label())], u64::from(*state == s));
            }
        }
        out.family(
            "webship_tls_ocsp_responses",
            Kind::Counter,
            "Verified OCSP answers fetched, by certificate status.",
        )
        .sample(&[("status", "good")], GOOD.load(Ordering::Relaxed))
        .sample(&[("status", "revoked")], REVOKED.load(Ordering::Relaxed));
        out.family(
            "webship_tls_ocsp_fetch_errors",
            Kind::Counter,
            "OCSP fetches that failed: unreachable responder, HTTP error, a response that does not verify, status unknown.",
        )
        .sample(&[], FETCH_ERRORS.load(Ordering::Relaxed));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(site: &str) -> SlotKey {
        SlotKey::self_signed(site)
    }

    fn running(slot: &Arc<CertSlot>) -> Task {
        Task {
            slot: slot.clone(),
            handle: tokio::spawn(std::future::pending()),
        }
    }

    /// A site removed and restored while its old stapler is still in a fetch gets a
    /// task for its new slot; the old task is ended, a task whose slot is still in
    /// the table is kept, and one whose slot left is ended.
    #[tokio::test]
    async fn a_restored_site_gets_a_task_for_its_new_slot() {
        let [old, new, kept, gone]: [Arc<CertSlot>; 4] = Default::default();
        let mut tasks = Tasks::default();
        tasks.0.insert(key("a"), running(&old));
        tasks.0.insert(key("b"), running(&kept));
        tasks.0.insert(key("c"), running(&gone));
        let old_task = tasks.0[&key("a")].handle.abort_handle();
        let gone_task = tasks.0[&key("c")].handle.abort_handle();

        let spawn = tasks.unstaffed(vec![(key("a"), new.clone()), (key("b"), kept.clone())]);

        assert_eq!(spawn.len(), 1, "one slot needs a task: {spawn:?}");
        assert_eq!(spawn[0].0, key("a"));
        assert!(Arc::ptr_eq(&spawn[0].1, &new), "the task is for the new slot");
        assert!(Arc::ptr_eq(&tasks.0[&key("b")].slot, &kept), "b keeps its task");
        assert!(!tasks.0.contains_key(&key("a")) && !tasks.0.contains_key(&key("c")));
        assert!(
            ends(|| old_task.is_finished()).await,
            "the old slot's task was not ended"
        );
        assert!(
            ends(|| gone_task.is_finished()).await,
            "the removed slot's task was not ended"
        );
    }

    /// A held staple is looked at within a minute, however far its fetch and expiry
    /// are; without one, the task sleeps until its fetch, at most an hour.
    #[test]
    fn a_held_staple_is_looked_at_every_minute() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
        let (day, hour) = (Duration::from_secs(86_400), Duration::from_secs(3600));
        assert_eq!(sleep_for(day, Some(now + 2 * day), now), STAPLE_SLEEP);
        assert_eq!(
            sleep_for(Duration::from_secs(7), Some(now + day), now),
            Duration::from_secs(7)
        );
        assert_eq!(
            sleep_for(day, Some(now + Duration::from_secs(20)), now),
            Duration::from_secs(20)
        );
        assert_eq!(sleep_for(day, Some(now - hour), now), Duration::ZERO);
        assert_eq!(sleep_for(day, None, now), MAX_SLEEP);
        assert_eq!(
            sleep_for(Duration::from_secs(90), None, now),
            Duration::from_secs(90)
        );
    }

    /// Whether `done` turns true within 5 s of yielding to other tasks.
    async fn ends(done: impl Fn() -> bool) -> bool {
        tokio::time::timeout(Duration::from_secs(5), async {
            while !done() {
                tokio::task::yield_now().await;
            }
        })
        .await
        .is_ok()
    }

    /// A finished task (its slot left the table once) is replaced, even when the
    /// table holds the same slot again.
    #[tokio::test]
    async fn a_finished_task_is_replaced() {
        let slot = Arc::<CertSlot>::default();
        let mut tasks = Tasks::default();
        let handle = tokio::spawn(async {});
        assert!(ends(|| handle.is_finished()).await, "an empty task did not end");
        tasks.0.insert(
            key("a"),
            Task {
                slot: slot.clone(),
                handle,
            },
        );
        let spawn = tasks.unstaffed(vec![(key("a"), slot.clone())]);
        assert_eq!(spawn.len(), 1);
        assert!(Arc::ptr_eq(&spawn[0].1, &slot));
    }
}
