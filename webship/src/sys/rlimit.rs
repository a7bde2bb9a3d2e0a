//! The open-file limit (`RLIMIT_NOFILE`): read it, and raise the soft limit within
//! the hard one (which only the operator raises: `LimitNOFILE=`, `ulimit -n`).

use std::io;

/// The soft and hard open-file limits; `u64::MAX` stands for unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NoFile {
    pub(crate) soft: u64,
    pub(crate) hard: u64,
}

#[cfg(unix)]
pub(crate) fn nofile() -> io::Result<NoFile> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable `rlimit` for the whole call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let wide = |v: libc::rlim_t| {
        if v == libc::RLIM_INFINITY {
            u64::MAX
        } else {
            #[allow(clippy::unnecessary_cast)] // rlim_t is not u64 everywhere
            {
                v as u64
            }
        }
    };
    Ok(NoFile {
        soft: wide(lim.rlim_cur),
        hard: wide(lim.rlim_max),
    })
}

/// Sets the soft limit to `soft` (at most the hard limit), leaving the hard one.
#[cfg(unix)]
pub(crate) fn set_nofile_soft(soft: u64) -> io::Result<()> {
    let now = nofile()?;
    let narrow = |v: u64| {
        if v == u64::MAX {
            libc::RLIM_INFINITY
        } else {
            libc::rlim_t::try_from(v).unwrap_or(libc::RLIM_INFINITY)
        }
    };
    let lim = libc::rlimit {
        rlim_cur: narrow(soft.min(now.hard)),
        rlim_max: narrow(now.hard),
    };
    // SAFETY: `lim` is a valid `rlimit`, read by the kernel for the whole call.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(not(unix))]
pub(crate) fn nofile() -> io::Result<NoFile> {
    Err(io::ErrorKind::Unsupported.into())
}

#[cfg(not(unix))]
pub(crate) fn set_nofile_soft(_soft: u64) -> io::Result<()> {
    Err(io::ErrorKind::Unsupported.into())
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_can_be_set_to_what_it_is() {
        let now = nofile().unwrap();
        assert!(now.soft <= now.hard);
        set_nofile_soft(now.soft).unwrap();
        assert_eq!(nofile().unwrap(), now);
    }
}
