//! Opening files from the document root without ever blocking on what is not a
//! regular file: `open(2)` of a FIFO for reading waits for a writer, forever, so the
//! open is non-blocking and the type is checked on the open descriptor.

use std::fs::File;
use std::io;
use std::path::Path;

/// Opens `path` read-only without waiting (a FIFO with no writer opens at once) and
/// without making a terminal the controlling one. The caller checks the type with
/// `fstat` and calls [`set_blocking`] on a regular file.
#[cfg(unix)]
pub(crate) fn open_nonblocking(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
}

#[cfg(not(unix))]
pub(crate) fn open_nonblocking(path: &Path) -> io::Result<File> {
    File::open(path)
}

/// Clears `O_NONBLOCK` again (regular files ignore it today, but a file system may
/// not, and reads of a served file must wait for the disk, never fail with EAGAIN).
#[cfg(unix)]
pub(crate) fn set_blocking(file: &File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: `fd` is an open descriptor owned by `file` for the whole call; F_GETFL
    // reads its status flags and touches no memory of ours.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    if flags & libc::O_NONBLOCK == 0 {
        return Ok(());
    }
    // SAFETY: as above; F_SETFL takes an int of flags and touches no memory of ours.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(not(unix))]
pub(crate) fn set_blocking(_file: &File) -> io::Result<()> {
    Ok(())
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn a_fifo_opens_at_once_and_a_file_becomes_blocking() {
        let dir = std::env::temp_dir().join(format!("webship-sys-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo");
        let _ = std::fs::remove_file(&fifo);
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.map(|s| s.success()).unwrap_or(false) {
            let f = open_nonblocking(&fifo).unwrap();
            assert!(!f.metadata().unwrap().is_file());
        }
        let plain = dir.join("plain");
        std::fs::write(&plain, b"x").unwrap();
        let f = open_nonblocking(&plain).unwrap();
        set_blocking(&f).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
