//! The one place with `unsafe` and raw socket options.
//!
//! Everything Linux-specific that has no safe wrapper in socket2 lives here behind a
//! small safe API; every other target gets a twin that returns `Unsupported`, so the
//! rest of the crate compiles and falls back to the portable rustls path everywhere.
#![allow(unsafe_code)]

use std::io;
use std::net::TcpStream;

/// Holds back partial frames until `set_cork(false)`, so a response head and the first
/// body bytes leave in full-sized segments (Linux `TCP_CORK`; best effort elsewhere).
pub fn set_cork<S: std::os::fd::AsFd>(sock: &S, cork: bool) -> io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        socket2::SockRef::from(sock).set_cork(cork)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (sock, cork);
        Err(io::ErrorKind::Unsupported.into())
    }
}

/// Sets the congestion-control algorithm of one TCP socket (`TCP_CONGESTION`).
pub fn set_congestion<S: std::os::fd::AsFd>(sock: &S, name: &str) -> io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        socket2::SockRef::from(sock).set_tcp_congestion(name.as_bytes())
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (sock, name);
        Err(io::ErrorKind::Unsupported.into())
    }
}

/// Reads back the congestion-control algorithm of one TCP socket.
pub fn congestion<S: std::os::fd::AsFd>(sock: &S) -> io::Result<String> {
    #[cfg(target_os = "linux")]
    {
        let raw = socket2::SockRef::from(sock).tcp_congestion()?;
        let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
        Ok(String::from_utf8_lossy(&raw[..end]).into_owned())
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = sock;
        Err(io::ErrorKind::Unsupported.into())
    }
}

/// Why the kernel refused kernel TLS on a socket.
#[derive(Debug, thiserror::Error)]
pub enum KtlsError {
    /// `TCP_ULP "tls"` failed: the `tls` upper-layer protocol is not in this kernel.
    #[error("the kernel has no `tls` TCP upper-layer protocol ({0})")]
    NoUlp(io::Error),
    /// The ULP attached, but the kernel refused the TX crypto parameters.
    #[error("the kernel refused TLS 1.3 AES-GCM-128 transmit keys ({0})")]
    TxRefused(io::Error),
    /// Not Linux.
    #[error("kernel TLS exists only on Linux")]
    Unsupported,
}

/// TLS 1.3 AES-128-GCM transmit parameters in the layout the kernel expects.
#[derive(Debug, Clone, Copy)]
pub struct Tls13AesGcm128Tx {
    pub key: [u8; 16],
    /// The 4-byte salt (implicit nonce prefix) followed by the 8-byte explicit IV.
    pub iv: [u8; 12],
    pub record_seq: u64,
}

/// Attaches the `tls` ULP to a connected TCP socket and installs transmit keys, so the
/// kernel encrypts everything written to the socket from now on (one-way, TX only).
#[cfg(target_os = "linux")]
pub fn enable_ktls_tx<S: std::os::fd::AsRawFd>(sock: &S, params: &Tls13AesGcm128Tx) -> Result<(), KtlsError> {
    let fd = sock.as_raw_fd();
    let ulp = b"tls";
    // SAFETY: `fd` is a live socket borrowed from `sock`; the option value is a valid
    // buffer of the length passed, and the kernel copies it before returning.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_TCP,
            libc::TCP_ULP,
            ulp.as_ptr().cast(),
            ulp.len() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(KtlsError::NoUlp(io::Error::last_os_error()));
    }
    // SAFETY: the struct is plain old data; all-zero is a valid value for every field.
    let mut info: libc::tls12_crypto_info_aes_gcm_128 = unsafe { std::mem::zeroed() };
    info.info.version = libc::TLS_1_3_VERSION;
    info.info.cipher_type = libc::TLS_CIPHER_AES_GCM_128;
    info.key.copy_from_slice(&params.key);
    info.salt.copy_from_slice(&params.iv[..4]);
    info.iv.copy_from_slice(&params.iv[4..]);
    info.rec_seq = params.record_seq.to_be_bytes();
    // SAFETY: as above; `info` lives across the call and its size is passed exactly.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_TLS,
            libc::TLS_TX,
            (&info as *const libc::tls12_crypto_info_aes_gcm_128).cast(),
            std::mem::size_of_val(&info) as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(KtlsError::TxRefused(io::Error::last_os_error()));
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
pub fn enable_ktls_tx<S>(_sock: &S, _params: &Tls13AesGcm128Tx) -> Result<(), KtlsError> {
    Err(KtlsError::Unsupported)
}

/// Reads from `file` at `offset` only what is already in the page cache
/// (`preadv2(RWF_NOWAIT)`): `Ok(n)` with `n > 0` bytes read without waiting,
/// `Ok(0)` at end of file, `Err(WouldBlock)` when the data would have to come from
/// the disk. Lets a reactor thread serve hot files without a thread hop.
#[cfg(target_os = "linux")]
pub fn pread_cached(file: &std::fs::File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    use rustix::io::{preadv2, ReadWriteFlags};
    let mut slices = [std::io::IoSliceMut::new(buf)];
    match preadv2(file, &mut slices, offset, ReadWriteFlags::NOWAIT) {
        Ok(n) => Ok(n),
        // Kernels or file systems without RWF_NOWAIT answer EOPNOTSUPP: treat as a miss.
        Err(e) if e == rustix::io::Errno::OPNOTSUPP || e == rustix::io::Errno::AGAIN => {
            Err(io::ErrorKind::WouldBlock.into())
        }
        Err(e) => Err(e.into()),
    }
}

#[cfg(not(target_os = "linux"))]
pub fn pread_cached(_file: &std::fs::File, _buf: &mut [u8], _offset: u64) -> io::Result<usize> {
    Err(io::ErrorKind::WouldBlock.into())
}

/// Opens a connected loopback TCP pair for probes that need a real established socket.
pub fn loopback_pair() -> io::Result<(TcpStream, TcpStream)> {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
    let client = TcpStream::connect(listener.local_addr()?)?;
    let (server, _) = listener.accept()?;
    Ok((client, server))
}
