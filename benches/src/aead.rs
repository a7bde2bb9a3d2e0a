//! The `aead` benchmark: which rustls crypto provider should Webship use here?
//!
//! Bulk TLS throughput is bounded by AES-GCM sealing, so each provider's
//! primitive is measured on full 16 KiB records (the TLS record payload
//! limit), and then the real path: a rustls server and client in memory, so
//! record framing, buffering and copies are counted as they are in production.

use std::hint::black_box;
use std::io::{ErrorKind, Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use rustls::{CipherSuite, ClientConfig, ClientConnection, ConnectionCommon, ServerConfig};
use rustls::{ServerConnection, SupportedCipherSuite};
use webship_testkit::pki::Pki;

const MIB: f64 = 1_048_576.0;
/// A full TLS record's plaintext.
const RECORD: usize = 16 * 1024;
const SEAL_BYTES: u64 = 1 << 30;
const SEAL_TIME: Duration = Duration::from_secs(2);
const SEAL_WARMUP_RECORDS: u64 = 4096;
const TLS_BYTES: u64 = 512 << 20;
const TLS_WARMUP_BYTES: u64 = 64 << 20;
/// Safety bound for the in-memory transfer, far above its expected duration.
const TLS_TIME: Duration = Duration::from_secs(60);
/// Plaintext handed to rustls per write: 16 records, the order of what a
/// server's send path passes down at once.
const TLS_WRITE: usize = 16 * RECORD;

/// Seals one record in place with the given nonce counter.
type Sealer = Box<dyn FnMut(u64, &mut [u8]) -> Result<()>>;

pub(crate) fn run() -> Result<()> {
    println!(
        "\nAES-GCM seal, {} KiB records, up to 1 GiB or 2 s each\n",
        RECORD / 1024
    );
    println!("| library | algorithm | MiB/s |");
    println!("|---|---|---:|");
    let seals: [(&str, &str, Sealer); 4] = [
        (
            "aws-lc-rs",
            "AES-128-GCM",
            aws_lc_sealer(&aws_lc_rs::aead::AES_128_GCM)?,
        ),
        ("ring", "AES-128-GCM", ring_sealer(&ring::aead::AES_128_GCM)?),
        (
            "aws-lc-rs",
            "AES-256-GCM",
            aws_lc_sealer(&aws_lc_rs::aead::AES_256_GCM)?,
        ),
        ("ring", "AES-256-GCM", ring_sealer(&ring::aead::AES_256_GCM)?),
    ];
    for (library, algorithm, seal) in seals {
        println!("| {library} | {algorithm} | {:.0} |", seal_rate(seal)?);
    }

    println!(
        "\nrustls 0.23 in memory, TLS 1.3 AES-128-GCM, {} MiB server→client, one thread\n",
        TLS_BYTES >> 20
    );
    println!("| provider | end-to-end MiB/s | server (seal) MiB/s | client (open) MiB/s |");
    println!("|---|---:|---:|---:|");
    let providers = [
        ("aws-lc-rs", rustls::crypto::aws_lc_rs::default_provider()),
        ("ring", rustls::crypto::ring::default_provider()),
    ];
    // The first transfer in a process runs at about half speed (heap growth,
    // page faults), whichever provider goes first; warm both before timing.
    for (name, provider) in &providers {
        rustls_transfer(provider.clone(), TLS_WARMUP_BYTES).with_context(|| format!("warming up {name}"))?;
    }
    let mut end_to_end = Vec::new();
    for (name, provider) in providers {
        let r =
            rustls_transfer(provider, TLS_BYTES).with_context(|| format!("rustls transfer with {name}"))?;
        println!(
            "| {name} | {:.0} | {:.0} | {:.0} |",
            r.end_to_end, r.server, r.client
        );
        end_to_end.push((name, r.end_to_end));
    }
    if let [(a, a_rate), (b, b_rate)] = end_to_end[..] {
        let (winner, ratio) = if a_rate >= b_rate {
            (a, a_rate / b_rate)
        } else {
            (b, b_rate / a_rate)
        };
        // Differences within a few percent are noise on a shared host; rerun before deciding.
        println!("\nfaster on the rustls path here: {winner} ({ratio:.2}x)");
    }
    Ok(())
}

/// Seals one record in place over and over; the nonce is a counter, as in TLS.
fn seal_rate(mut seal: impl FnMut(u64, &mut [u8]) -> Result<()>) -> Result<f64> {
    let mut record = vec![0x5au8; RECORD];
    // Untimed: lets the clock ramp up and the key schedule settle in cache.
    for counter in 0..SEAL_WARMUP_RECORDS {
        seal(counter, &mut record)?;
    }
    let start = Instant::now();
    let mut sealed = 0u64;
    while sealed < SEAL_BYTES && start.elapsed() < SEAL_TIME {
        seal(SEAL_WARMUP_RECORDS + sealed / RECORD as u64, &mut record)?;
        sealed += RECORD as u64;
    }
    black_box(&record);
    Ok(sealed as f64 / start.elapsed().as_secs_f64() / MIB)
}

const KEY: [u8; 32] = [7; 32];

fn nonce(counter: u64) -> [u8; 12] {
    let mut nonce = [0u8; 12];
    nonce[4..].copy_from_slice(&counter.to_be_bytes());
    nonce
}

// ring and aws-lc-rs share an API but not types, hence two near-identical constructors.

fn ring_sealer(algorithm: &'static ring::aead::Algorithm) -> Result<Sealer> {
    use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey};
    let key =
        UnboundKey::new(algorithm, &KEY[..algorithm.key_len()]).map_err(|_| anyhow!("ring: bad key"))?;
    let key = LessSafeKey::new(key);
    Ok(Box::new(move |counter, record| {
        let nonce = Nonce::assume_unique_for_key(nonce(counter));
        let tag = key
            .seal_in_place_separate_tag(nonce, Aad::empty(), record)
            .map_err(|_| anyhow!("ring: seal failed"))?;
        let _ = black_box(tag);
        Ok(())
    }))
}

fn aws_lc_sealer(algorithm: &'static aws_lc_rs::aead::Algorithm) -> Result<Sealer> {
    use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey};
    let key =
        UnboundKey::new(algorithm, &KEY[..algorithm.key_len()]).map_err(|_| anyhow!("aws-lc-rs: bad key"))?;
    let key = LessSafeKey::new(key);
    Ok(Box::new(move |counter, record| {
        let nonce = Nonce::assume_unique_for_key(nonce(counter));
        let tag = key
            .seal_in_place_separate_tag(nonce, Aad::empty(), record)
            .map_err(|_| anyhow!("aws-lc-rs: seal failed"))?;
        let _ = black_box(tag);
        Ok(())
    }))
}

#[derive(Debug)]
struct TransferRates {
    end_to_end: f64,
    server: f64,
    client: f64,
}

/// Sends `bytes` of application data from a rustls server to a rustls
/// client through memory, timing each side's share of the work separately.
fn rustls_transfer(provider: CryptoProvider, bytes: u64) -> Result<TransferRates> {
    let suite = only_aes128(&provider)?;
    let provider = Arc::new(CryptoProvider {
        cipher_suites: vec![suite],
        ..provider
    });
    let (mut server, mut client) = connected_pair(provider)?;
    let negotiated = server.negotiated_cipher_suite().map(|s| s.suite());
    if negotiated != Some(CipherSuite::TLS13_AES_128_GCM_SHA256) {
        bail!("negotiated {negotiated:?}, expected TLS13_AES_128_GCM_SHA256");
    }
    // Unlimited: each write is sealed at once and drained right after, so the
    // buffer never holds more than one TLS_WRITE worth of records.
    server.set_buffer_limit(None);

    let payload = vec![0x5au8; TLS_WRITE];
    let mut wire = Vec::with_capacity(TLS_WRITE + TLS_WRITE / 8);
    let mut plaintext = vec![0u8; TLS_WRITE];
    let (mut server_time, mut client_time) = (Duration::ZERO, Duration::ZERO);
    let (mut sent, mut received) = (0u64, 0u64);
    let start = Instant::now();
    while sent < bytes {
        if start.elapsed() > TLS_TIME {
            bail!("transfer took over {TLS_TIME:?} ({sent} of {bytes} bytes sent)");
        }
        let t = Instant::now();
        server.writer().write_all(&payload)?;
        flush(&mut server, &mut wire)?;
        server_time += t.elapsed();
        sent += payload.len() as u64;

        let t = Instant::now();
        received += deliver(&wire, &mut client, &mut plaintext)?;
        client_time += t.elapsed();
    }
    let total = start.elapsed();
    if received != sent {
        bail!("client received {received} bytes of {sent}");
    }
    let mib = sent as f64 / MIB;
    Ok(TransferRates {
        end_to_end: mib / total.as_secs_f64(),
        server: mib / server_time.as_secs_f64(),
        client: mib / client_time.as_secs_f64(),
    })
}

fn only_aes128(provider: &CryptoProvider) -> Result<SupportedCipherSuite> {
    provider
        .cipher_suites
        .iter()
        .copied()
        .find(|s| s.suite() == CipherSuite::TLS13_AES_128_GCM_SHA256)
        .context("provider lacks TLS13_AES_128_GCM_SHA256")
}

/// A TLS 1.3 server/client pair with a completed handshake, the server's
/// certificate from a fresh private CA, which is all the client trusts.
fn connected_pair(provider: Arc<CryptoProvider>) -> Result<(ServerConnection, ClientConnection)> {
    let dir = tempfile::tempdir().context("creating a scratch directory")?;
    let pki = Pki::new(dir.path())?;
    let leaf = pki.leaf("localhost", &["localhost"])?;
    let cert = CertificateDer::from(leaf.der);
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf.key_der));

    let server_config = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(vec![cert], key)?;
    let client_config = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(pki.roots()?)
        .with_no_client_auth();

    let mut server = ServerConnection::new(Arc::new(server_config))?;
    let mut client = ClientConnection::new(Arc::new(client_config), ServerName::try_from("localhost")?)?;
    let mut wire = Vec::new();
    let mut scratch = vec![0u8; RECORD];
    // A TLS 1.3 handshake needs two round trips; the bound only stops a stuck loop.
    for _ in 0..10 {
        if !server.is_handshaking() && !client.is_handshaking() {
            return Ok((server, client));
        }
        flush(&mut client, &mut wire)?;
        deliver(&wire, &mut server, &mut scratch)?;
        flush(&mut server, &mut wire)?;
        deliver(&wire, &mut client, &mut scratch)?;
    }
    bail!("handshake did not complete")
}

/// Moves everything `from` has to send into `wire` (replacing its contents).
fn flush<D>(from: &mut ConnectionCommon<D>, wire: &mut Vec<u8>) -> Result<()> {
    wire.clear();
    while from.wants_write() {
        from.write_tls(wire)?;
    }
    Ok(())
}

/// Feeds `wire` to `to` and drains its plaintext into `scratch` as it
/// arrives (rustls refuses more input while too much plaintext is unread).
/// Returns the plaintext byte count.
fn deliver<D>(wire: &[u8], to: &mut ConnectionCommon<D>, scratch: &mut [u8]) -> Result<u64> {
    let mut input = wire;
    let mut received = 0u64;
    while !input.is_empty() {
        to.read_tls(&mut input)?;
        to.process_new_packets()?;
        loop {
            match to.reader().read(scratch) {
                Ok(0) => break,
                Ok(n) => received += n as u64,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => return Err(e.into()),
            }
        }
    }
    black_box(&scratch);
    Ok(received)
}
