//! Stand-ins for a build without eBPF (not Linux, or the `ebpf` feature off): every
//! entry point says so, and passthrough uses a userspace engine.

use std::io;
use std::os::fd::BorrowedFd;
use std::path::Path;
use std::sync::Arc;

use super::{EbpfError, Snapshot, Values};

pub fn embedded() -> bool {
    false
}

pub fn probe() -> Result<String, EbpfError> {
    Err(EbpfError::NotBuilt)
}

pub fn read_pinned(dir: &Path) -> Result<Snapshot, EbpfError> {
    Err(EbpfError::NotRunning(dir.to_owned()))
}

/// Never constructed in this build.
#[derive(Debug)]
pub enum Programs {}

impl Programs {
    pub fn load(_: &Path) -> Result<Arc<Self>, EbpfError> {
        Err(EbpfError::NotBuilt)
    }

    pub fn link(self: &Arc<Self>, _: BorrowedFd<'_>, _: BorrowedFd<'_>) -> io::Result<SocketLink> {
        match **self {}
    }

    pub fn redirect_udp(
        &self,
        _: std::net::SocketAddrV4,
        _: std::net::SocketAddrV4,
    ) -> Result<(), EbpfError> {
        match *self {}
    }

    pub fn publish(&self, _: &Values) {
        match *self {}
    }

    pub fn kernel_counters(&self) -> Values {
        match *self {}
    }
}

/// Never constructed in this build.
#[derive(Debug)]
pub enum SocketLink {}

impl SocketLink {
    pub fn open_client(&self) -> io::Result<()> {
        match *self {}
    }

    pub fn redirected(&self) -> (u64, u64) {
        match *self {}
    }
}
