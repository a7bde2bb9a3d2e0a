//! Giving up root: the service account's ids, and the switch of one thread to it
//! with only the capabilities it still needs and no way back (`PR_SET_NO_NEW_PRIVS`).
//!
//! Every call acts on the calling thread only. The set*id functions of glibc change
//! every thread of the process (through a signal), but capabilities, the bounding set,
//! keep-caps and no-new-privs are per-thread attributes that no libc call spreads. So
//! [`switch_thread`] uses the raw system calls for all of it, and each thread of the
//! daemon runs it itself (`server::process` makes every runtime thread do so before
//! it serves anything); a thread started later inherits its creator's credentials.
//!
//! Order matters: the bounding set is cut while the thread still has `CAP_SETPCAP`;
//! keep-caps is set before the uid changes (otherwise the kernel empties the permitted
//! set); groups before gid before uid (each needs the privilege the next one drops);
//! then the permitted and effective sets are cut to what is kept.

use std::ffi::CString;
use std::fmt;
use std::io;

/// Why the service account cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PrivilegeError {
    #[error("user `{0}` does not exist (fix: create it, e.g. `useradd --system --no-create-home {0}`, or name an existing account in `user`)")]
    UnknownUser(String),
    #[error("group `{0}` does not exist (fix: create it, e.g. `groupadd --system {0}`, or name an existing group in `group`)")]
    UnknownGroup(String),
    #[error("cannot look up `{name}`: {source}")]
    Lookup {
        name: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot switch to user `{user}` ({step}): {source}")]
    Switch {
        user: String,
        step: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("switching users is not supported on this system")]
    Unsupported,
}

/// A service account, resolved: the ids the daemon switches to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Account {
    pub(crate) user: String,
    pub(crate) uid: u32,
    pub(crate) gid: u32,
    /// Supplementary groups: the user's memberships (as `initgroups` would set them,
    /// and nginx and systemd do), the primary group included.
    pub(crate) groups: Vec<u32>,
}

/// A set of Linux capabilities, by number (`CAP_*` in `linux/capability.h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Caps(u64);

impl Caps {
    pub(crate) const NET_ADMIN: Caps = Caps(1 << 12);
    pub(crate) const BPF: Caps = Caps(1 << 39);

    pub(crate) const fn empty() -> Self {
        Caps(0)
    }

    pub(crate) fn with(self, other: Caps) -> Self {
        Caps(self.0 | other.0)
    }

    pub(crate) fn contains(self, cap: u32) -> bool {
        cap < 64 && self.0 & (1 << cap) != 0
    }

    pub(crate) fn bits(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Caps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names = Vec::new();
        for (bit, name) in [(12, "CAP_NET_ADMIN"), (39, "CAP_BPF")] {
            if self.contains(bit) {
                names.push(name);
            }
        }
        if names.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&names.join(", "))
        }
    }
}

/// The calling thread's real, effective and saved user ids.
#[cfg(target_os = "linux")]
pub(crate) fn thread_uids() -> [u32; 3] {
    let mut ids: [libc::uid_t; 3] = [0; 3];
    // SAFETY: the three pointers are valid, writable `uid_t`s for the whole call;
    // getresuid cannot fail with valid pointers.
    unsafe {
        libc::syscall(
            libc::SYS_getresuid,
            &mut ids[0] as *mut libc::uid_t,
            &mut ids[1] as *mut libc::uid_t,
            &mut ids[2] as *mut libc::uid_t,
        )
    };
    ids
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn thread_uids() -> [u32; 3] {
    [u32::MAX; 3]
}

/// Resolves `user` (a name, or a number) and `group` (default: the user's primary
/// group) from the system's account database.
#[cfg(target_os = "linux")]
pub(crate) fn lookup(user: &str, group: Option<&str>) -> Result<Account, PrivilegeError> {
    let (uid, primary) = match passwd(user)? {
        Some(ids) => ids,
        None => match user.parse::<u32>() {
            // A bare number with no passwd entry: its group must be named.
            Ok(uid) if group.is_some() => (uid, u32::MAX),
            _ => return Err(PrivilegeError::UnknownUser(user.to_owned())),
        },
    };
    let gid = match group {
        Some(g) => match group_id(g)? {
            Some(gid) => gid,
            None => match g.parse::<u32>() {
                Ok(gid) => gid,
                Err(_) => return Err(PrivilegeError::UnknownGroup(g.to_owned())),
            },
        },
        None => primary,
    };
    let mut groups = memberships(user, gid)?;
    if !groups.contains(&gid) {
        groups.insert(0, gid);
    }
    Ok(Account {
        user: user.to_owned(),
        uid,
        gid,
        groups,
    })
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn lookup(_user: &str, _group: Option<&str>) -> Result<Account, PrivilegeError> {
    Err(PrivilegeError::Unsupported)
}

/// The uid and primary gid of the passwd entry `name`.
#[cfg(target_os = "linux")]
fn passwd(name: &str) -> Result<Option<(u32, u32)>, PrivilegeError> {
    let c = c_name(name)?;
    let mut buf = vec![0 as libc::c_char; 4096];
    loop {
        // SAFETY: `passwd` is plain data; zeroed is a valid value that getpwnam_r
        // overwrites.
        let mut entry: libc::passwd = unsafe { std::mem::zeroed() };
        let mut found: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the call; `buf` is writable for
        // `buf.len()` bytes and outlives the read of `entry` below, which only uses
        // the two id fields (not the strings that point into `buf`).
        let rc = unsafe { libc::getpwnam_r(c.as_ptr(), &mut entry, buf.as_mut_ptr(), buf.len(), &mut found) };
        match rc {
            0 if found.is_null() => return Ok(None),
            0 => return Ok(Some((entry.pw_uid, entry.pw_gid))),
            libc::ERANGE if buf.len() < 1 << 20 => buf.resize(buf.len() * 2, 0),
            // "Not found" comes back as one of these from some NSS modules.
            libc::ENOENT | libc::ESRCH | libc::EBADF | libc::EPERM => return Ok(None),
            e => return Err(lookup_error(name, e)),
        }
    }
}

/// The gid of the group entry `name`.
#[cfg(target_os = "linux")]
fn group_id(name: &str) -> Result<Option<u32>, PrivilegeError> {
    let c = c_name(name)?;
    let mut buf = vec![0 as libc::c_char; 4096];
    loop {
        // SAFETY: `group` is plain data; zeroed is a valid value that getgrnam_r
        // overwrites.
        let mut entry: libc::group = unsafe { std::mem::zeroed() };
        let mut found: *mut libc::group = std::ptr::null_mut();
        // SAFETY: as in `passwd`; only the gid is read afterwards.
        let rc = unsafe { libc::getgrnam_r(c.as_ptr(), &mut entry, buf.as_mut_ptr(), buf.len(), &mut found) };
        match rc {
            0 if found.is_null() => return Ok(None),
            0 => return Ok(Some(entry.gr_gid)),
            libc::ERANGE if buf.len() < 1 << 20 => buf.resize(buf.len() * 2, 0),
            libc::ENOENT | libc::ESRCH | libc::EBADF | libc::EPERM => return Ok(None),
            e => return Err(lookup_error(name, e)),
        }
    }
}

/// The groups `user` belongs to (`getgrouplist`), `gid` first.
#[cfg(target_os = "linux")]
fn memberships(user: &str, gid: u32) -> Result<Vec<u32>, PrivilegeError> {
    let c = c_name(user)?;
    let mut groups: Vec<libc::gid_t> = vec![0; 64];
    for _ in 0..8 {
        let mut n = libc::c_int::try_from(groups.len()).unwrap_or(libc::c_int::MAX);
        // SAFETY: `groups` is writable for `n` entries; getgrouplist writes at most
        // `n` and stores the number it needs in `n`.
        let rc = unsafe { libc::getgrouplist(c.as_ptr(), gid, groups.as_mut_ptr(), &mut n) };
        let n = usize::try_from(n).unwrap_or(0);
        if rc >= 0 {
            groups.truncate(n.min(groups.len()));
            return Ok(groups);
        }
        groups.resize(n.max(groups.len() * 2), 0);
    }
    Ok(vec![gid])
}

#[cfg(target_os = "linux")]
fn c_name(name: &str) -> Result<CString, PrivilegeError> {
    CString::new(name).map_err(|_| PrivilegeError::UnknownUser(name.to_owned()))
}

#[cfg(target_os = "linux")]
fn lookup_error(name: &str, errno: i32) -> PrivilegeError {
    PrivilegeError::Lookup {
        name: name.to_owned(),
        source: io::Error::from_raw_os_error(errno),
    }
}

/// The highest capability number this kernel knows.
#[cfg(target_os = "linux")]
fn last_cap() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(63)
        .min(63)
}

/// Switches the calling thread to `account`, keeping only `keep` (permitted,
/// effective and bounding), nothing inheritable or ambient, and no new privileges
/// through exec. Irreversible for this thread.
#[cfg(target_os = "linux")]
pub(crate) fn switch_thread(account: &Account, keep: Caps) -> Result<(), PrivilegeError> {
    let fail = |step: &'static str| {
        let source = io::Error::last_os_error();
        move || PrivilegeError::Switch {
            user: account.user.clone(),
            step,
            source,
        }
    };
    for cap in 0..=last_cap() {
        if keep.contains(cap) {
            continue;
        }
        // SAFETY: prctl with integer arguments only; no memory is passed.
        let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap), 0, 0, 0) };
        // EINVAL: a capability this kernel does not have. EPERM: started without
        // CAP_SETPCAP (a container that dropped it); the bounding set then stays as
        // it is, which no-new-privs below makes moot (it only limits what an exec
        // could gain, and no exec gains anything any more).
        match (rc, io::Error::last_os_error().raw_os_error()) {
            (0, _) | (_, Some(libc::EINVAL)) => {}
            (_, Some(libc::EPERM)) => break,
            _ => return Err(fail("dropping the capability bounding set")()),
        }
    }
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_KEEPCAPS, 1, 0, 0, 0) } != 0 {
        return Err(fail("PR_SET_KEEPCAPS")());
    }
    // SAFETY: `groups` is a valid array of `len` gid_t for the whole call; the kernel
    // only reads it.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_setgroups,
            account.groups.len() as libc::size_t,
            account.groups.as_ptr(),
        )
    };
    if rc != 0 {
        return Err(fail("setgroups")());
    }
    let (u, g) = (account.uid, account.gid);
    // SAFETY: integer arguments only; raw so that it changes this thread alone.
    if unsafe { libc::syscall(libc::SYS_setresgid, g, g, g) } != 0 {
        return Err(fail("setresgid")());
    }
    // SAFETY: integer arguments only; raw so that it changes this thread alone.
    if unsafe { libc::syscall(libc::SYS_setresuid, u, u, u) } != 0 {
        return Err(fail("setresuid")());
    }
    set_caps(keep).map_err(|_| fail("capset")())?;
    // SAFETY: prctl with integer arguments only.
    unsafe {
        libc::prctl(libc::PR_SET_KEEPCAPS, 0, 0, 0, 0);
        // Older kernels have no ambient set (EINVAL); it is empty there anyway.
        libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    }
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(fail("PR_SET_NO_NEW_PRIVS")());
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn switch_thread(_account: &Account, _keep: Caps) -> Result<(), PrivilegeError> {
    Err(PrivilegeError::Unsupported)
}

/// `_LINUX_CAPABILITY_VERSION_3`: two 32-bit words per set.
#[cfg(target_os = "linux")]
const CAP_V3: u32 = 0x2008_0522;

#[cfg(target_os = "linux")]
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[cfg(target_os = "linux")]
#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Sets this thread's effective and permitted sets to `keep`, inheritable to none.
#[cfg(target_os = "linux")]
fn set_caps(keep: Caps) -> io::Result<()> {
    let bits = keep.bits();
    let word = |w: u32| CapData {
        effective: w,
        permitted: w,
        inheritable: 0,
    };
    let mut header = CapHeader {
        version: CAP_V3,
        pid: 0,
    };
    let data = [word(bits as u32), word((bits >> 32) as u32)];
    // SAFETY: `header` and `data` are valid `repr(C)` layouts of the kernel's
    // `__user_cap_header_struct` and two `__user_cap_data_struct`s (version 3), alive
    // for the call; pid 0 is the calling thread.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &mut header as *mut CapHeader, data.as_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn root_and_nobody_resolve_and_strangers_do_not() {
        let root = lookup("root", None).unwrap();
        assert_eq!((root.uid, root.gid), (0, 0));
        assert!(root.groups.contains(&0));
        assert!(matches!(
            lookup("no-such-user-webship", None),
            Err(PrivilegeError::UnknownUser(_))
        ));
        assert!(matches!(
            lookup("root", Some("no-such-group-webship")),
            Err(PrivilegeError::UnknownGroup(_))
        ));
    }

    #[test]
    fn caps_name_themselves() {
        assert_eq!(Caps::empty().to_string(), "none");
        let both = Caps::BPF.with(Caps::NET_ADMIN);
        assert_eq!(both.to_string(), "CAP_NET_ADMIN, CAP_BPF");
        assert_eq!(both.bits(), (1 << 12) | (1 << 39));
    }
}
