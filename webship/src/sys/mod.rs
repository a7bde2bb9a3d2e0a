//! The one place with `unsafe` and raw socket options.
//!
//! Everything Linux-specific that has no safe wrapper in socket2 lives here behind a
//! small safe API; every other target gets a twin that returns `Unsupported`, so the
//! rest of the crate compiles and falls back to the portable rustls path everywhere.
#![allow(unsafe_code)]

pub(crate) mod fdpass;
pub(crate) mod file;
pub(crate) mod heap;
pub mod notify;
pub(crate) mod privilege;
pub(crate) mod rlimit;
pub(crate) mod route;
pub(crate) mod udp;

use std::io;
use std::net::TcpStream;

/// Holds back partial frames until `set_cork(false)`, so a response head and the first
/// body bytes leave in full-sized segments (Linux `TCP_CORK`; best effort elsewhere).
pub(crate) fn set_cork<S: std::os::fd::AsFd>(sock: &S, cork: bool) -> io::Result<()> {
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

/// Sends the ACK of what was just read now instead of after the delayed-ACK timer
/// (Linux `TCP_QUICKACK`; best effort elsewhere): for a read that nothing of ours
/// answers, when a client that holds small writes back until its last one is
/// acknowledged (Nagle's algorithm) may be waiting on that ACK.
pub(crate) fn ack_now<S: std::os::fd::AsFd>(sock: &S) -> io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        socket2::SockRef::from(sock).set_quickack(true)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = sock;
        Err(io::ErrorKind::Unsupported.into())
    }
}

/// Sets the congestion-control algorithm of one TCP socket (`TCP_CONGESTION`).
pub(crate) fn set_congestion<S: std::os::fd::AsFd>(sock: &S, name: &str) -> io::Result<()> {
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

/// Cumulative byte counts of one TCP connection, from `TCP_INFO`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct TcpBytes {
    /// Bytes this side sent that the peer acknowledged (`tcpi_bytes_acked`).
    pub acked: u64,
    /// Sequence space received from the peer (`tcpi_bytes_received`; a FIN counts one).
    pub received: u64,
}

/// Reads [`TcpBytes`] of a connected TCP socket.
pub(crate) fn tcp_bytes<S: std::os::fd::AsRawFd>(sock: &S) -> io::Result<TcpBytes> {
    #[cfg(target_os = "linux")]
    {
        let info = tcp_info(sock)?;
        Ok(TcpBytes {
            acked: info.tcpi_bytes_acked,
            received: info.tcpi_bytes_received,
        })
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = sock;
        Err(io::ErrorKind::Unsupported.into())
    }
}

/// Bytes written to a TCP socket that it has not sent yet (`tcpi_notsent_bytes`):
/// they wait for the peer's receive window (or the congestion window).
pub(crate) fn tcp_unsent<S: std::os::fd::AsRawFd>(sock: &S) -> io::Result<u64> {
    #[cfg(target_os = "linux")]
    {
        // Before Linux 4.6 the kernel does not write it: zero, nothing seen waiting.
        Ok(u64::from(tcp_info(sock)?.tcpi_notsent_bytes))
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = sock;
        Err(io::ErrorKind::Unsupported.into())
    }
}

/// What a TCP socket takes now without blocking, in bytes: its send buffer's size
/// less what is queued in it (`SO_MEMINFO`: `sk_sndbuf - sk_wmem_queued`, the
/// numbers the kernel itself compares before it accepts a write). Both count the
/// kernel's bookkeeping as well as the payload, so the payload that fits is at least
/// this much.
pub(crate) fn tcp_send_room<S: std::os::fd::AsRawFd>(sock: &S) -> io::Result<u64> {
    #[cfg(target_os = "linux")]
    {
        let info = meminfo(sock)?;
        let at = |i: libc::c_int| u64::from(info[i as usize]);
        Ok(at(libc::SK_MEMINFO_SNDBUF).saturating_sub(at(libc::SK_MEMINFO_WMEM_QUEUED)))
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = sock;
        Err(io::ErrorKind::Unsupported.into())
    }
}

/// `SO_MEMINFO` of include/uapi/asm-generic/socket.h (libc does not export it at its
/// root); the architectures with their own numbering get `Unsupported`.
#[cfg(all(
    target_os = "linux",
    not(any(
        target_arch = "mips",
        target_arch = "mips64",
        target_arch = "sparc64",
        target_arch = "powerpc",
        target_arch = "powerpc64"
    ))
))]
const SO_MEMINFO: libc::c_int = 55;

/// `SK_MEMINFO_VARS`: how many values `SO_MEMINFO` writes (Linux 4.x and later).
#[cfg(target_os = "linux")]
const MEMINFO_VARS: usize = 9;

#[cfg(target_os = "linux")]
fn meminfo<S: std::os::fd::AsRawFd>(sock: &S) -> io::Result<[u32; MEMINFO_VARS]> {
    #[cfg(any(
        target_arch = "mips",
        target_arch = "mips64",
        target_arch = "sparc64",
        target_arch = "powerpc",
        target_arch = "powerpc64"
    ))]
    {
        let _ = sock;
        Err(io::ErrorKind::Unsupported.into())
    }
    #[cfg(not(any(
        target_arch = "mips",
        target_arch = "mips64",
        target_arch = "sparc64",
        target_arch = "powerpc",
        target_arch = "powerpc64"
    )))]
    {
        let mut info = [0u32; MEMINFO_VARS];
        let mut len = std::mem::size_of_val(&info) as libc::socklen_t;
        // SAFETY: `info` is writable for `len` bytes, and the kernel writes at most
        // `len` bytes and updates `len`; the fd is borrowed for the call.
        let rc = unsafe {
            libc::getsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                SO_MEMINFO,
                info.as_mut_ptr().cast(),
                &mut len,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // The queued count is the sixth value (Linux 3.x and later).
        if (len as usize) < (libc::SK_MEMINFO_WMEM_QUEUED as usize + 1) * 4 {
            return Err(io::ErrorKind::Unsupported.into());
        }
        Ok(info)
    }
}

/// What `TCP_INFO` says about a connection's recent traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TcpActivity {
    /// Since the last data segment was received (`tcpi_last_data_recv`).
    pub since_received: std::time::Duration,
    /// Since the last new data was sent (`tcpi_last_data_sent`; retransmissions,
    /// keepalive and window probes do not count).
    pub since_sent: std::time::Duration,
    /// Whether a FIN went either way: the connection is no longer `ESTABLISHED`.
    pub half_closed: bool,
}

/// Reads [`TcpActivity`] of a connected TCP socket.
pub(crate) fn tcp_activity<S: std::os::fd::AsRawFd>(sock: &S) -> io::Result<TcpActivity> {
    #[cfg(target_os = "linux")]
    {
        let info = tcp_info(sock)?;
        // `TCP_ESTABLISHED` of include/net/tcp_states.h (libc does not export it).
        const ESTABLISHED: u8 = 1;
        let ms = |v: u32| std::time::Duration::from_millis(u64::from(v));
        Ok(TcpActivity {
            since_received: ms(info.tcpi_last_data_recv),
            since_sent: ms(info.tcpi_last_data_sent),
            half_closed: info.tcpi_state != ESTABLISHED,
        })
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = sock;
        Err(io::ErrorKind::Unsupported.into())
    }
}

#[cfg(target_os = "linux")]
fn tcp_info<S: std::os::fd::AsRawFd>(sock: &S) -> io::Result<libc::tcp_info> {
    // SAFETY: `tcp_info` is plain old data, so all-zeroes is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` is writable for `len` bytes, and the kernel writes at most
    // `len` bytes and updates `len`; the fd is borrowed for the call.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            std::ptr::from_mut(&mut info).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // The fields read here exist since Linux 4.2; an older kernel writes fewer bytes.
    let needed = std::mem::offset_of!(libc::tcp_info, tcpi_bytes_received) + 8;
    if (len as usize) < needed {
        return Err(io::ErrorKind::Unsupported.into());
    }
    Ok(info)
}

/// Dead-peer detection for a long-lived relayed connection: keepalive probes after
/// `idle` without traffic, every `interval`, `probes` of them; and
/// `TCP_USER_TIMEOUT`, so data the peer never acknowledges (a vanished client)
/// ends the connection after `user_timeout` instead of ~15 minutes of
/// retransmissions. Best effort where an option is missing.
pub(crate) fn set_dead_peer_detection<S: std::os::fd::AsFd>(
    sock: &S,
    idle: std::time::Duration,
    interval: std::time::Duration,
    probes: u32,
    user_timeout: std::time::Duration,
) -> io::Result<()> {
    let sock = socket2::SockRef::from(sock);
    let keepalive = socket2::TcpKeepalive::new().with_time(idle);
    #[cfg(any(target_os = "linux", target_os = "android", target_os = "freebsd"))]
    let keepalive = keepalive.with_interval(interval).with_retries(probes);
    #[cfg(not(any(target_os = "linux", target_os = "android", target_os = "freebsd")))]
    let _ = (interval, probes);
    sock.set_tcp_keepalive(&keepalive)?;
    #[cfg(target_os = "linux")]
    sock.set_tcp_user_timeout(Some(user_timeout))?;
    #[cfg(not(target_os = "linux"))]
    let _ = user_timeout;
    Ok(())
}

/// Reads back the congestion-control algorithm of one TCP socket.
pub(crate) fn congestion<S: std::os::fd::AsFd>(sock: &S) -> io::Result<String> {
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
pub(crate) enum KtlsError {
    /// `TCP_ULP "tls"` failed: the `tls` upper-layer protocol is not in this kernel.
    #[error("the kernel has no `tls` TCP upper-layer protocol ({0})")]
    NoUlp(io::Error),
    /// The ULP attached, but the kernel refused the crypto parameters.
    #[error("the kernel refused {0} keys ({1})")]
    Refused(&'static str, io::Error),
    /// Key material of the wrong size for the cipher.
    #[error("key material does not fit the cipher")]
    BadKeys,
    /// Not Linux.
    #[error("kernel TLS exists only on Linux")]
    Unsupported,
}

/// TLS protocol versions the kernel can take over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum KtlsVersion {
    Tls12,
    Tls13,
}

/// AEAD ciphers the kernel can take over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum KtlsCipher {
    Aes128Gcm,
    Aes256Gcm,
    Chacha20Poly1305,
}

/// Which half of the connection the keys are for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KtlsDirection {
    Tx,
    Rx,
}

/// One direction's traffic keys, as rustls hands them over.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KtlsKeys<'a> {
    pub version: KtlsVersion,
    pub cipher: KtlsCipher,
    pub key: &'a [u8],
    /// The 12-byte IV: for the GCM ciphers, the 4-byte salt then 8 bytes.
    pub iv: &'a [u8],
    /// Sequence number of the next record in this direction.
    pub seq: u64,
}

/// Attaches the `tls` upper-layer protocol to a connected TCP socket. Nothing changes
/// on the wire until keys are installed, so a failure here loses nothing.
#[cfg(target_os = "linux")]
pub(crate) fn attach_tls_ulp<S: std::os::fd::AsRawFd>(sock: &S) -> Result<(), KtlsError> {
    let ulp = b"tls";
    // SAFETY: the fd is a live socket borrowed from `sock`; the option value is a valid
    // buffer of the length passed, and the kernel copies it before returning.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_TCP,
            libc::TCP_ULP,
            ulp.as_ptr().cast(),
            ulp.len() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(KtlsError::NoUlp(io::Error::last_os_error()));
    }
    Ok(())
}

/// Installs one direction's keys on a socket with the `tls` ULP attached: from now on
/// the kernel encrypts what is written (TX) or decrypts what is read (RX).
#[cfg(target_os = "linux")]
pub(crate) fn set_ktls_keys<S: std::os::fd::AsRawFd>(
    sock: &S,
    direction: KtlsDirection,
    keys: &KtlsKeys<'_>,
) -> Result<(), KtlsError> {
    let version = match keys.version {
        KtlsVersion::Tls12 => libc::TLS_1_2_VERSION,
        KtlsVersion::Tls13 => libc::TLS_1_3_VERSION,
    };
    let name = match direction {
        KtlsDirection::Tx => libc::TLS_TX,
        KtlsDirection::Rx => libc::TLS_RX,
    };
    let seq = keys.seq.to_be_bytes();
    let fd = sock.as_raw_fd();
    let refused = |what| move |e| KtlsError::Refused(what, e);
    if keys.iv.len() != 12 {
        return Err(KtlsError::BadKeys);
    }
    match keys.cipher {
        KtlsCipher::Aes128Gcm => {
            // SAFETY: plain old data; all-zero is valid for every field.
            let mut info: libc::tls12_crypto_info_aes_gcm_128 = unsafe { std::mem::zeroed() };
            info.info.version = version;
            info.info.cipher_type = libc::TLS_CIPHER_AES_GCM_128;
            copy(&mut info.key, keys.key)?;
            info.salt.copy_from_slice(&keys.iv[..4]);
            info.iv.copy_from_slice(&keys.iv[4..]);
            info.rec_seq = seq;
            setsockopt_struct(fd, libc::SOL_TLS, name, &info).map_err(refused("AES-128-GCM"))
        }
        KtlsCipher::Aes256Gcm => {
            // SAFETY: plain old data; all-zero is valid for every field.
            let mut info: libc::tls12_crypto_info_aes_gcm_256 = unsafe { std::mem::zeroed() };
            info.info.version = version;
            info.info.cipher_type = libc::TLS_CIPHER_AES_GCM_256;
            copy(&mut info.key, keys.key)?;
            info.salt.copy_from_slice(&keys.iv[..4]);
            info.iv.copy_from_slice(&keys.iv[4..]);
            info.rec_seq = seq;
            setsockopt_struct(fd, libc::SOL_TLS, name, &info).map_err(refused("AES-256-GCM"))
        }
        KtlsCipher::Chacha20Poly1305 => {
            // SAFETY: plain old data; all-zero is valid for every field.
            let mut info: libc::tls12_crypto_info_chacha20_poly1305 = unsafe { std::mem::zeroed() };
            info.info.version = version;
            info.info.cipher_type = libc::TLS_CIPHER_CHACHA20_POLY1305;
            copy(&mut info.key, keys.key)?;
            info.iv.copy_from_slice(keys.iv);
            info.rec_seq = seq;
            setsockopt_struct(fd, libc::SOL_TLS, name, &info).map_err(refused("ChaCha20-Poly1305"))
        }
    }
}

#[cfg(target_os = "linux")]
fn copy(dst: &mut [u8], src: &[u8]) -> Result<(), KtlsError> {
    if dst.len() != src.len() {
        return Err(KtlsError::BadKeys);
    }
    dst.copy_from_slice(src);
    Ok(())
}

/// Removes the BPF program of the `SO_REUSEPORT` group `sock` belongs to, if it has
/// one (one a predecessor attached; `false`: there was none). The group then picks
/// sockets by its hash again.
#[cfg(target_os = "linux")]
pub(crate) fn detach_reuseport_program<S: std::os::fd::AsRawFd>(sock: &S) -> io::Result<bool> {
    // The kernel finds the group from the socket; the value is not read, but must be
    // an int-sized buffer.
    let unused: libc::c_int = 0;
    match setsockopt_struct(
        sock.as_raw_fd(),
        libc::SOL_SOCKET,
        libc::SO_DETACH_REUSEPORT_BPF,
        &unused,
    ) {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn detach_reuseport_program<S>(_sock: &S) -> io::Result<bool> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "SO_DETACH_REUSEPORT_BPF is Linux-only",
    ))
}

#[cfg(target_os = "linux")]
fn setsockopt_struct<T>(fd: libc::c_int, level: libc::c_int, name: libc::c_int, value: &T) -> io::Result<()> {
    // SAFETY: `value` is a live reference to a plain-old-data struct whose exact size is
    // passed; the kernel copies it before returning.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (value as *const T).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Room for control messages, aligned for `cmsghdr`: `CMSG_FIRSTHDR` hands back the
/// buffer's start as a `*mut cmsghdr`, and writing through a misaligned one is
/// undefined behaviour (a plain byte array has alignment 1).
#[cfg(target_os = "linux")]
#[repr(C, align(8))]
struct CmsgBuffer([u8; 64]);

#[cfg(target_os = "linux")]
const _: () = assert!(std::mem::align_of::<CmsgBuffer>() >= std::mem::align_of::<libc::cmsghdr>());

#[cfg(target_os = "linux")]
impl CmsgBuffer {
    fn new() -> Self {
        Self([0; 64])
    }
}

/// Sends a TLS `close_notify` alert through kernel TLS (a record of type alert, not
/// application data, chosen with the `TLS_SET_RECORD_TYPE` control message).
#[cfg(target_os = "linux")]
pub(crate) fn ktls_send_close_notify<S: std::os::fd::AsRawFd>(sock: &S) -> io::Result<()> {
    const ALERT: u8 = 21;
    let mut payload = [1u8, 0u8]; // level warning, description close_notify
                                  // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(1) } as usize;
    let mut control = CmsgBuffer::new();
    let control = &mut control.0[..space];
    let mut iov = libc::iovec {
        iov_base: payload.as_mut_ptr().cast(),
        iov_len: payload.len(),
    };
    // SAFETY: msghdr is plain old data; zeroed is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg_control points at `space` valid bytes, enough for one cmsg with a
    // one-byte payload, so CMSG_FIRSTHDR is non-null and CMSG_DATA is in bounds.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_TLS;
        (*cmsg).cmsg_type = libc::TLS_SET_RECORD_TYPE;
        (*cmsg).cmsg_len = libc::CMSG_LEN(1) as _;
        *libc::CMSG_DATA(cmsg) = ALERT;
    }
    // SAFETY: every pointer in `msg` refers to locals that outlive the call.
    let rc = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_DONTWAIT) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// `sendfile(2)` from `file` at `*offset` into `sock`, advancing `offset`. The socket
/// is non-blocking: `WouldBlock` means wait for writability.
#[cfg(target_os = "linux")]
pub(crate) fn sendfile<S: std::os::fd::AsRawFd>(
    sock: &S,
    file: &std::fs::File,
    offset: &mut u64,
    count: usize,
) -> io::Result<usize> {
    use std::os::fd::AsRawFd as _;
    let mut off = libc::off_t::try_from(*offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: both fds are live for the call; `off` is a valid local the kernel updates.
    let n = unsafe { libc::sendfile(sock.as_raw_fd(), file.as_raw_fd(), &mut off, count) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    *offset = u64::try_from(off).unwrap_or(*offset);
    Ok(n as usize)
}

#[cfg(not(target_os = "linux"))]
pub fn attach_tls_ulp<S>(_sock: &S) -> Result<(), KtlsError> {
    Err(KtlsError::Unsupported)
}

#[cfg(not(target_os = "linux"))]
pub fn set_ktls_keys<S>(_sock: &S, _direction: KtlsDirection, _keys: &KtlsKeys<'_>) -> Result<(), KtlsError> {
    Err(KtlsError::Unsupported)
}

#[cfg(not(target_os = "linux"))]
pub fn ktls_send_close_notify<S>(_sock: &S) -> io::Result<()> {
    Err(io::ErrorKind::Unsupported.into())
}

#[cfg(not(target_os = "linux"))]
pub fn sendfile<S>(_sock: &S, _file: &std::fs::File, _offset: &mut u64, _count: usize) -> io::Result<usize> {
    Err(io::ErrorKind::Unsupported.into())
}

/// Appends up to `want` bytes of `file` at `offset` to `buf`, without zeroing the
/// room first (a memset pass per chunk is measurable on the bulk path). With `nowait`
/// only what the page cache already holds is read, and a miss is `WouldBlock`.
/// Returns how many bytes were appended; 0 is end of file.
#[cfg(target_os = "linux")]
pub(crate) fn pread_append(
    file: &std::fs::File,
    buf: &mut bytes::BytesMut,
    want: usize,
    offset: u64,
    nowait: bool,
) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    buf.reserve(want);
    let spare = &mut buf.spare_capacity_mut()[..want];
    let iov = libc::iovec {
        iov_base: spare.as_mut_ptr().cast(),
        iov_len: spare.len(),
    };
    let offset = libc::off_t::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let flags = if nowait { libc::RWF_NOWAIT } else { 0 };
    // SAFETY: `iov` describes `want` bytes of `buf`'s spare capacity, writable and
    // alive for the whole call; the kernel writes at most `iov_len` bytes there.
    let n = unsafe { libc::preadv2(file.as_raw_fd(), &iov, 1, offset, flags) };
    if n < 0 {
        let e = io::Error::last_os_error();
        // Kernels or file systems without RWF_NOWAIT answer EOPNOTSUPP: a miss.
        let miss = matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EOPNOTSUPP));
        return Err(if nowait && miss {
            io::ErrorKind::WouldBlock.into()
        } else {
            e
        });
    }
    let n = n as usize;
    // SAFETY: the kernel initialised the first `n` (<= `want`) bytes of the spare
    // capacity, which directly follows the initialised part of `buf`.
    unsafe { buf.set_len(buf.len() + n) };
    Ok(n)
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn pread_append(
    file: &std::fs::File,
    buf: &mut bytes::BytesMut,
    want: usize,
    offset: u64,
    nowait: bool,
) -> io::Result<usize> {
    if nowait {
        return Err(io::ErrorKind::WouldBlock.into());
    }
    let start = buf.len();
    buf.resize(start + want, 0);
    #[cfg(unix)]
    let n = std::os::unix::fs::FileExt::read_at(file, &mut buf[start..], offset);
    #[cfg(not(unix))]
    let n = std::os::windows::fs::FileExt::seek_read(file, &mut buf[start..], offset);
    buf.truncate(start + *n.as_ref().unwrap_or(&0));
    n
}

/// Opens a connected loopback TCP pair for probes that need a real established socket.
pub(crate) fn loopback_pair() -> io::Result<(TcpStream, TcpStream)> {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
    let client = TcpStream::connect(listener.local_addr()?)?;
    let (server, _) = listener.accept()?;
    Ok((client, server))
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn control_buffers_are_aligned_for_cmsghdr() {
        // On the stack after an odd-sized local and inside a struct after a byte:
        // wherever it lands, its start can hold a cmsghdr.
        let odd = [0u8; 3];
        let plain = CmsgBuffer::new();
        struct After {
            _byte: u8,
            buffer: CmsgBuffer,
        }
        let after = After {
            _byte: odd[0],
            buffer: CmsgBuffer::new(),
        };
        for buffer in [&plain, &after.buffer] {
            let addr = buffer.0.as_ptr() as usize;
            assert_eq!(addr % std::mem::align_of::<libc::cmsghdr>(), 0);
        }
        // SAFETY: CMSG_SPACE only computes a size.
        let space = unsafe { libc::CMSG_SPACE(1) } as usize;
        assert!(space <= plain.0.len());
    }
}
