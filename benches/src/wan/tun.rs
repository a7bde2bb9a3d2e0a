//! The one place in the benches with `unsafe`: attaching a file descriptor to a
//! new TUN device (the `TUNSETIFF` ioctl, which no safe wrapper we depend on
//! offers). Everything after that is plain `read`/`write` on a [`File`].

#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;

/// `_IOW('T', 202, int)` from linux/if_tun.h.
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
/// Layer 3 packets, no link header.
const IFF_TUN: libc::c_short = 0x0001;
/// No 4-byte packet-information prefix: each read is exactly one IP packet.
const IFF_NO_PI: libc::c_short = 0x1000;
/// `IFNAMSIZ`, the NUL included.
const NAME_LEN: usize = 16;

/// `struct ifreq` as TUNSETIFF reads it: the name, then the flags at the start
/// of the 24-byte union (40 bytes in all on 64-bit Linux).
#[repr(C)]
struct IfReq {
    name: [u8; NAME_LEN],
    flags: libc::c_short,
    _union_rest: [u8; 22],
}

/// Creates the TUN device `name` (owned by this descriptor: it disappears when
/// the last descriptor closes) and returns it non-blocking, for a poll loop.
pub(super) fn open(name: &str) -> io::Result<File> {
    if name.is_empty()
        || name.len() >= NAME_LEN
        || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("TUN name {name:?}: 1 to 15 ASCII letters, digits or '-'"),
        ));
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open("/dev/net/tun")?;
    let mut req = IfReq {
        name: [0; NAME_LEN],
        flags: IFF_TUN | IFF_NO_PI,
        _union_rest: [0; 22],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: the descriptor is open and owned by `file` for the whole call;
    // `req` is a live, properly aligned `struct ifreq` layout (40 bytes, name
    // NUL-terminated since it is shorter than IFNAMSIZ) that the kernel reads
    // and writes only within its size during the call.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, &mut req as *mut IfReq) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(file)
}
