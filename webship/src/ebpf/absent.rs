//! Stand-ins for a build without eBPF (not Linux, or the `ebpf` feature off): every
//! entry point says so, and passthrough uses a userspace engine.

use std::io;
use std::os::fd::BorrowedFd;
use std::path::Path;
use std::sync::Arc;

use super::{EbpfError, Snapshot, TcpSnapshot, Values};

pub(crate) fn probe() -> Result<String, EbpfError> {
    Err(EbpfError::NotBuilt)
}

pub(crate) fn probe_tcp() -> Result<String, EbpfError> {
    Err(EbpfError::NotBuilt)
}

pub fn read_pinned(dir: &Path) -> Result<Snapshot, EbpfError> {
    Err(EbpfError::NotRunning(dir.to_owned()))
}

pub fn read_tcp_pinned(dir: &Path) -> Result<TcpSnapshot, EbpfError> {
    Err(EbpfError::NotRunning(dir.to_owned()))
}

/// Never constructed in this build.
#[derive(Debug)]
pub(crate) enum Programs {}

impl Programs {
    pub(crate) fn load(_: &Path, _: Option<std::os::fd::OwnedFd>, _: usize) -> Result<Arc<Self>, EbpfError> {
        Err(EbpfError::NotBuilt)
    }

    pub(crate) fn watch_tcp(&self) -> Result<std::path::PathBuf, EbpfError> {
        match *self {}
    }

    pub(crate) fn watch_port(&self, _: u16) {
        match *self {}
    }

    pub(crate) fn tcp_slot(&self, _: &str) -> Option<u32> {
        match *self {}
    }

    pub(crate) fn tag_tcp(&self, _: BorrowedFd<'_>, _: u32) {
        match *self {}
    }

    pub(crate) fn tcp_snapshot(&self) -> TcpSnapshot {
        match *self {}
    }

    pub(crate) fn pin_lock(&self) -> BorrowedFd<'_> {
        match *self {}
    }

    pub(crate) fn pin_dir(&self) -> &Path {
        match *self {}
    }

    pub(crate) fn hand_over(&self) {
        match *self {}
    }

    pub(crate) fn adopt_pins(&self) {
        match *self {}
    }

    pub(crate) fn link(self: &Arc<Self>, _: BorrowedFd<'_>, _: BorrowedFd<'_>) -> io::Result<SocketLink> {
        match **self {}
    }

    pub(crate) fn redirect_udp(
        &self,
        _: std::net::SocketAddrV4,
        _: std::net::SocketAddrV4,
    ) -> Result<(), EbpfError> {
        match *self {}
    }

    pub(crate) fn steer_quic<S: std::os::fd::AsFd>(&self, _: &[S]) -> Result<(), EbpfError> {
        match *self {}
    }

    pub(crate) fn publish(&self, _: &Values) {
        match *self {}
    }

    pub(crate) fn kernel_counters(&self) -> Values {
        match *self {}
    }

    pub(crate) fn linked_sockets(&self) -> u64 {
        match *self {}
    }
}

/// Never constructed in this build.
#[derive(Debug)]
pub(crate) enum SocketLink {}

impl SocketLink {
    pub(crate) fn refused(&self) -> Option<&io::Error> {
        match *self {}
    }

    pub(crate) fn redirected(&self) -> (u64, u64) {
        match *self {}
    }
}
