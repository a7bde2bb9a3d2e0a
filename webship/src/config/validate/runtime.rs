//! `[runtime.settings]`: every key must be one this build knows (a typo must not
//! silently leave a default in place), every value a whole number in its range; then
//! the checks that relate two keys.

use std::collections::BTreeMap;

use crate::config::{H2Settings, H3Settings, ProxyH2Settings};

use super::Validator;

impl Validator<'_> {
    pub(super) fn settings(
        &mut self,
        settings: &BTreeMap<String, String>,
    ) -> (H2Settings, H3Settings, ProxyH2Settings) {
        let mut h2 = H2Settings::default();
        let mut h3 = H3Settings::default();
        let mut proxy = ProxyH2Settings::default();
        for (name, value) in settings {
            let key = format!("runtime.settings.{name}");
            let Some(spec) = SETTINGS.iter().find(|s| s.name == name) else {
                let known: Vec<&str> = SETTINGS.iter().map(|s| s.name).collect();
                self.problem(
                    key,
                    "unknown setting",
                    format!("use one of: {}", known.join(", ")),
                );
                continue;
            };
            let parsed = value.trim().parse::<u64>().ok();
            let Some(n) = parsed.filter(|n| (spec.min..=spec.max).contains(n)) else {
                self.problem(
                    key,
                    format!(
                        "`{value}` is not a whole number from {} to {}",
                        spec.min, spec.max
                    ),
                    format!("write it as a quoted number, e.g. \"{}\"", spec.example),
                );
                continue;
            };
            // The ranges above keep every value inside its target type.
            let as_u32 = u32::try_from(n).unwrap_or(u32::MAX);
            let as_usize = usize::try_from(n).unwrap_or(usize::MAX);
            match spec.name {
                "h2_tls_write_buffer_bytes" => h2.tls_write_buffer_bytes = as_usize,
                "h2_initial_stream_window_bytes" => h2.initial_stream_window_bytes = as_u32,
                "h2_initial_connection_window_bytes" => h2.initial_connection_window_bytes = as_u32,
                "h2_max_frame_size_bytes" => h2.max_frame_size_bytes = as_u32,
                "h2_max_concurrent_streams" => h2.max_concurrent_streams = as_u32,
                "h2_max_send_buffer_bytes" => h2.max_send_buffer_bytes = as_usize,
                "h3_send_window_bytes" => h3.send_window_bytes = n,
                "h3_stream_receive_window_bytes" => h3.stream_receive_window_bytes = as_u32,
                "h3_receive_window_bytes" => h3.receive_window_bytes = as_u32,
                "h3_max_concurrent_streams" => h3.max_concurrent_streams = as_u32,
                "h3_mtu_upper_bound_bytes" => h3.mtu_upper_bound_bytes = u16::try_from(n).unwrap_or(u16::MAX),
                "h3_gso" => h3.gso = n == 1,
                "h3_bbr_switch_bytes" => h3.bbr_switch_bytes = n,
                "h3_retry" => h3.always_retry = n == 1,
                "proxy_h2_tls_max_send_buffer_bytes" => proxy.tls_max_send_buffer_bytes = as_usize,
                "proxy_h2_tls_connection_send_buffer_bytes" => {
                    proxy.tls_connection_send_buffer_bytes = as_usize
                }
                _ => unreachable!("every entry of SETTINGS is matched"),
            }
        }
        if h2.initial_connection_window_bytes < h2.initial_stream_window_bytes {
            self.problem(
                "runtime.settings.h2_initial_connection_window_bytes",
                "smaller than h2_initial_stream_window_bytes, so one stream could never use its window",
                "make the connection window at least the stream window",
            );
        }
        if proxy.tls_connection_send_buffer_bytes < proxy.tls_max_send_buffer_bytes {
            self.problem(
                "runtime.settings.proxy_h2_tls_connection_send_buffer_bytes",
                "smaller than proxy_h2_tls_max_send_buffer_bytes (the per-stream buffer)",
                "make the connection budget at least one stream's buffer (e.g. 131072 x streams)",
            );
        }
        (h2, h3, proxy)
    }
}

struct SettingSpec {
    name: &'static str,
    min: u64,
    max: u64,
    example: &'static str,
}

/// The `[runtime.settings]` keys this build knows; values are strings holding numbers.
const SETTINGS: &[SettingSpec] = &[
    SettingSpec {
        name: "h2_tls_write_buffer_bytes",
        min: 16 * 1024,
        max: 16 * 1024 * 1024,
        example: "131072",
    },
    SettingSpec {
        name: "h2_initial_stream_window_bytes",
        min: 65_535,
        max: (1 << 31) - 1,
        example: "1048576",
    },
    SettingSpec {
        name: "h2_initial_connection_window_bytes",
        min: 65_535,
        max: (1 << 31) - 1,
        example: "16777216",
    },
    SettingSpec {
        name: "h2_max_frame_size_bytes",
        min: 16_384,
        max: (1 << 24) - 1,
        example: "65536",
    },
    SettingSpec {
        name: "h2_max_concurrent_streams",
        min: 1,
        max: 10_000,
        example: "256",
    },
    SettingSpec {
        name: "h2_max_send_buffer_bytes",
        min: 16 * 1024,
        max: 64 * 1024 * 1024,
        example: "262144",
    },
    SettingSpec {
        name: "h3_send_window_bytes",
        min: 64 * 1024,
        max: 1024 * 1024 * 1024,
        example: "16777216",
    },
    SettingSpec {
        name: "h3_stream_receive_window_bytes",
        min: 16 * 1024,
        max: 1 << 30,
        example: "1048576",
    },
    SettingSpec {
        name: "h3_receive_window_bytes",
        min: 16 * 1024,
        max: 1 << 30,
        example: "8388608",
    },
    SettingSpec {
        name: "h3_max_concurrent_streams",
        min: 1,
        max: 10_000,
        example: "256",
    },
    SettingSpec {
        name: "h3_mtu_upper_bound_bytes",
        min: 1200,
        max: 65_527,
        example: "1452",
    },
    SettingSpec {
        name: "h3_gso",
        min: 0,
        max: 1,
        example: "1",
    },
    SettingSpec {
        name: "h3_bbr_switch_bytes",
        min: 0,
        max: 1 << 40,
        example: "1048576",
    },
    SettingSpec {
        name: "h3_retry",
        min: 0,
        max: 1,
        example: "0",
    },
    SettingSpec {
        name: "proxy_h2_tls_max_send_buffer_bytes",
        min: 16 * 1024,
        max: 64 * 1024 * 1024,
        example: "131072",
    },
    SettingSpec {
        name: "proxy_h2_tls_connection_send_buffer_bytes",
        min: 16 * 1024,
        max: 4 * 1024 * 1024 * 1024,
        example: "33554432",
    },
];
