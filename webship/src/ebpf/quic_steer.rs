//! HTTP/3 socket steering from the daemon's side (Linux, feature `ebpf`): the
//! `webship_quic_steer` SK_REUSEPORT program on the group of the QUIC sockets
//! (`h3_sockets`), with each socket at its index in `QUIC_SOCKETS`.
//!
//! The program belongs to the group, a kernel object every socket of the port
//! shares, not to this process: attaching replaces whatever program the group had
//! (a predecessor's, across a binary upgrade), and it stays attached when this
//! process exits, until the last socket closes; its map goes with it. The kernel
//! lets a socket be in one REUSEPORT_SOCKARRAY only (`EBUSY` otherwise), so a
//! successor cannot put the sockets it inherits into a map of its own while the
//! predecessor's holds them: it loads its programs with the predecessor's map
//! (pinned as `quic_sockets`, see `loaded.rs`), puts each socket it adds at its own
//! index (the inherited ones are there already and stay untouched), and attaches
//! its program. The inherited sockets keep their indices (the
//! predecessor hands them over in index order), so the predecessor's connection
//! IDs still select the socket they named, now read by the successor, which
//! forwards their datagrams by tag. Should the successor fail before it serves, its
//! program stays on the group with the same map: its own sockets leave the map as
//! they close, the inherited ones stay where the predecessor's IDs expect them.

use std::os::fd::AsFd;

use aya::maps::MapError;
use aya::programs::SkReuseport;
use aya::Ebpf;
use webship_ebpf_common::{MAX_QUIC_SOCKETS, QUIC_SOCKETS_MAP, QUIC_STEER_PROGRAM};

use super::loaded::{chain, lock, Programs};

/// `bpf_map_update_elem` flag: only into an empty slot (`EEXIST` otherwise).
const BPF_NOEXIST: u64 = 1;
use super::EbpfError;

impl Programs {
    /// Steers the QUIC datagrams of the `SO_REUSEPORT` group `sockets` belong to in
    /// the kernel: a datagram whose connection ID names socket `i` goes to
    /// `sockets[i]`, so `sockets` must be in the order of the indices the connection
    /// IDs carry. Replaces the group's program, if it had one.
    pub(crate) fn steer_quic<S: AsFd>(&self, sockets: &[S]) -> Result<(), EbpfError> {
        let Some(first) = sockets.first() else {
            return Ok(());
        };
        if sockets.len() > MAX_QUIC_SOCKETS as usize {
            return Err(EbpfError::Load(format!(
                "{} QUIC sockets, the steering map holds {MAX_QUIC_SOCKETS}",
                sockets.len()
            )));
        }
        let mut map = lock(&self.quic_sockets);
        // Filled before the program is attached: it never sees a half-filled group.
        for (index, socket) in (0u32..).zip(sockets) {
            match map.set(index, &socket.as_fd(), BPF_NOEXIST) {
                Ok(()) => {}
                // Taken: a socket inherited with the map, at the index its IDs name
                // (the predecessor hands them over in index order). Left as it is:
                // taking it out to put it back would leave the predecessor's program
                // without that slot should putting it back fail.
                Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => {}
                Err(e) => {
                    return Err(EbpfError::Load(format!(
                        "adding QUIC socket {index} to `{QUIC_SOCKETS_MAP}`: {}",
                        chain(&e)
                    )))
                }
            }
        }
        drop(map);
        let mut ebpf = lock(&self.ebpf);
        let program = load_steer(&mut ebpf)?;
        program
            .attach(first)
            .map_err(|e| EbpfError::Load(format!("attaching to the QUIC sockets' group: {}", chain(&e))))
    }
}

/// The steering program, loaded into the kernel (once).
pub(super) fn load_steer(ebpf: &mut Ebpf) -> Result<&mut SkReuseport, EbpfError> {
    let program: &mut SkReuseport = ebpf
        .program_mut(QUIC_STEER_PROGRAM)
        .ok_or_else(|| EbpfError::Load(format!("the object has no program `{QUIC_STEER_PROGRAM}`")))?
        .try_into()
        .map_err(|e| EbpfError::Load(chain(&e)))?;
    if program.fd().is_err() {
        program.load().map_err(|e| EbpfError::Load(chain(&e)))?;
    }
    Ok(program)
}
