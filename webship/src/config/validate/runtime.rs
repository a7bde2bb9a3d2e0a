//! `[runtime.settings]`: every key must be one the table in `config/settings.rs`
//! knows (a typo must not silently leave a default in place), every value a whole
//! number in its range; then the checks that relate two keys.

use std::collections::BTreeMap;

use crate::config::settings::{self, Tuned};
use crate::config::{H2Settings, H3Settings, ProxyH2Settings};

use super::Validator;

impl Validator<'_> {
    pub(super) fn settings(
        &mut self,
        raw: &BTreeMap<String, String>,
    ) -> (H2Settings, H3Settings, ProxyH2Settings) {
        let mut tuned = Tuned::default();
        for (name, value) in raw {
            let key = format!("runtime.settings.{name}");
            let Some(setting) = settings::find(name) else {
                let known: Vec<&str> = settings::names().collect();
                self.problem(
                    key,
                    "unknown setting",
                    format!("use one of: {}", known.join(", ")),
                );
                continue;
            };
            match setting.parse(value) {
                Some(n) => setting.set(&mut tuned, n),
                None => self.problem(
                    key,
                    format!("`{value}` is not {}", setting.accepted()),
                    setting.fix(),
                ),
            }
        }
        let Tuned { h2, h3, proxy_h2 } = tuned;
        if h2.initial_connection_window_bytes < h2.initial_stream_window_bytes {
            self.problem(
                "runtime.settings.h2_initial_connection_window_bytes",
                "smaller than h2_initial_stream_window_bytes, so one stream could never use its window",
                "make the connection window at least the stream window",
            );
        }
        if proxy_h2.tls_connection_send_buffer_bytes < proxy_h2.tls_max_send_buffer_bytes {
            self.problem(
                "runtime.settings.proxy_h2_tls_connection_send_buffer_bytes",
                "smaller than proxy_h2_tls_max_send_buffer_bytes (the per-stream buffer)",
                "make the connection budget at least one stream's buffer (e.g. 131072 x streams)",
            );
        }
        (h2, h3, proxy_h2)
    }
}
