//! `[kernel]`: how preflight treats kTLS, BBR, eBPF and TCP health, and where the
//! eBPF counter maps are pinned. The passthrough engines may still raise `ebpf` to required.

use std::path::PathBuf;

use crate::config::raw::RawKernel;
use crate::config::{Kernel, Policy};

use super::Validator;

impl Validator<'_> {
    pub(super) fn kernel(&mut self, raw: RawKernel) -> Kernel {
        let kernel = Kernel {
            ktls: raw.ktls.unwrap_or(Policy::Auto),
            bbr: raw.bbr.unwrap_or(Policy::Auto),
            ebpf: raw.ebpf.unwrap_or(Policy::Auto),
            tcp_health: raw.tcp_health.unwrap_or(Policy::Off),
            bpf_pin_dir: raw
                .bpf_pin_dir
                .unwrap_or_else(|| PathBuf::from(crate::config::DEFAULT_PIN_DIR)),
        };
        // `auto` without eBPF is reported by preflight and runs without it.
        if kernel.tcp_health == Policy::Required && kernel.ebpf == Policy::Off {
            self.problem(
                "kernel.tcp_health",
                "\"required\" needs eBPF, but `ebpf` is \"off\"",
                "set `ebpf = \"auto\"` (or \"required\"), or `tcp_health = \"auto\"` or \"off\"",
            );
        }
        if !kernel.bpf_pin_dir.is_absolute() {
            self.problem(
                "kernel.bpf_pin_dir",
                format!("`{}` is not an absolute path", kernel.bpf_pin_dir.display()),
                "use a folder under the BPF filesystem, such as \"/sys/fs/bpf/webship\"",
            );
        }
        kernel
    }
}
