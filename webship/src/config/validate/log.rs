//! `[log]` and `[sites.log]`: the access log's switch, format, file and sampling.
//!
//! The file is only checked here (an absolute path whose folder exists); it is opened
//! at start, as root, by the server, and reopened on SIGUSR1.

use std::path::PathBuf;

use crate::config::raw::{RawLog, RawSiteLog};
use crate::config::AccessLog;

use super::Validator;

impl Validator<'_> {
    /// `[log]`; absent means the log is off (and would be `combined` on stderr).
    pub(super) fn access_log(&mut self, raw: Option<&RawLog>) -> AccessLog {
        let Some(raw) = raw else {
            return AccessLog::default();
        };
        let sample = raw
            .access_sample
            .map_or(1.0, |s| self.sample("log.access_sample", s));
        AccessLog {
            enabled: raw.access.unwrap_or(false),
            format: raw.access_format.unwrap_or_default(),
            path: raw.access_path.as_ref().and_then(|p| self.log_path(p)),
            sample,
        }
    }

    /// `[sites.log]`: the site's rate, or `None` to take `[log]`'s.
    pub(super) fn site_log(&mut self, key: &str, raw: &RawSiteLog) -> Option<f64> {
        match (raw.access, raw.access_sample) {
            (Some(false), Some(_)) => {
                self.problem(
                    format!("{key}.access_sample"),
                    "a sampling rate for a site whose access log is off",
                    "remove `access = false` or `access_sample`",
                );
                Some(0.0)
            }
            (Some(false), None) => Some(0.0),
            (_, Some(s)) => Some(self.sample(&format!("{key}.access_sample"), s)),
            (Some(true), None) => Some(1.0),
            (None, None) => None,
        }
    }

    /// A share of exchanges: a number from 0 to 1.
    fn sample(&mut self, key: &str, share: f64) -> f64 {
        if share.is_finite() && (0.0..=1.0).contains(&share) {
            return share;
        }
        self.problem(
            key,
            format!("{share} is not a share of exchanges"),
            "use a number from 0 (none) to 1 (every exchange), e.g. 0.1 for one in ten",
        );
        1.0
    }

    /// `access_path`: relative to the configuration file's folder; that folder of the
    /// log must exist (the daemon creates the file, not folders).
    fn log_path(&mut self, path: &std::path::Path) -> Option<PathBuf> {
        let full = self.path(path);
        let folder = full.parent().filter(|p| !p.as_os_str().is_empty());
        // A reload validates as the service account, which may not enter a log folder
        // only root may (the file was opened by root at start): only what is known
        // to be wrong is refused, not what cannot be looked at.
        let missing = |p: &std::path::Path| matches!(std::fs::metadata(p), Err(e) if e.kind() == std::io::ErrorKind::NotFound);
        let problem = if path.as_os_str().is_empty() || full.file_name().is_none() {
            Some("is not a file name")
        } else if std::fs::metadata(&full).is_ok_and(|m| m.is_dir()) {
            Some("is a folder")
        } else if folder.is_some_and(missing) {
            Some("is in a folder that does not exist")
        } else if folder.is_some_and(|f| std::fs::metadata(f).is_ok_and(|m| !m.is_dir())) {
            Some("is in something that is not a folder")
        } else {
            None
        };
        match problem {
            Some(p) => {
                self.problem(
                    "log.access_path",
                    format!("`{}` {p}", path.display()),
                    "name a file in an existing folder, e.g. \"/var/log/webship/access.log\" (leave it out for standard error)",
                );
                None
            }
            None => Some(full),
        }
    }
}
