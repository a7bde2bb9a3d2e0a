//! Host name → entry, the one lookup rule for every table keyed by domain: the
//! sites (by SNI and by `Host`) and the passthrough routes (by SNI).
//!
//! The rule, as nginx's `server_name`: an exact name first, then the longest matching
//! wildcard, then the catch-all. Names compare without ASCII case and without
//! trailing dots (an SNI or `Host` of `a.test.` is `a.test`, for passthrough routes
//! too).

use crate::config::DomainPattern;

/// Entries in configuration order, each answering for one [`DomainPattern`].
#[derive(Debug, Clone)]
pub(crate) struct NameTable<T> {
    entries: Vec<(DomainPattern, T)>,
}

impl<T> NameTable<T> {
    pub(crate) fn new(entries: impl IntoIterator<Item = (DomainPattern, T)>) -> Self {
        Self {
            entries: entries.into_iter().collect(),
        }
    }

    /// The entry answering for `host`, if any.
    pub(crate) fn lookup(&self, host: &str) -> Option<&T> {
        let host = host.trim_end_matches('.');
        let exact = self
            .entries
            .iter()
            .find(|(d, _)| matches!(d, DomainPattern::Exact(_)) && d.matches(host));
        let wildcard = || {
            self.entries
                .iter()
                .filter(|(d, _)| matches!(d, DomainPattern::Wildcard(_)) && d.matches(host))
                // The longest suffix; the first of equals (max_by_key keeps the last).
                .rev()
                .max_by_key(|(d, _)| match d {
                    DomainPattern::Wildcard(suffix) => suffix.len(),
                    _ => 0,
                })
        };
        let any = || self.entries.iter().find(|(d, _)| *d == DomainPattern::Any);
        exact.or_else(wildcard).or_else(any).map(|(_, v)| v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(domains: &[DomainPattern]) -> NameTable<usize> {
        NameTable::new(domains.iter().cloned().zip(0..))
    }

    #[test]
    fn exact_then_longest_wildcard_then_any() {
        let t = table(&[
            DomainPattern::Wildcard(".example.com".into()),
            DomainPattern::Wildcard(".cdn.example.com".into()),
            DomainPattern::Exact("a.cdn.example.com".into()),
            DomainPattern::Any,
        ]);
        assert_eq!(t.lookup("A.CDN.example.com"), Some(&2));
        assert_eq!(t.lookup("b.cdn.example.com"), Some(&1));
        assert_eq!(t.lookup("x.example.com."), Some(&0));
        assert_eq!(t.lookup("example.com"), Some(&3));
        let no_default = table(&[DomainPattern::Exact("a.test".into())]);
        assert_eq!(no_default.lookup("b.test"), None);
    }

    #[test]
    fn equal_wildcards_resolve_to_the_first() {
        let t = table(&[
            DomainPattern::Wildcard(".a.test".into()),
            DomainPattern::Wildcard(".a.test".into()),
        ]);
        assert_eq!(t.lookup("x.a.test"), Some(&0));
    }

    #[test]
    fn every_trailing_dot_is_ignored_as_before_the_name_table() {
        // service::SiteTable (65ec5f3) trimmed every trailing dot of a Host or SNI
        // (`trim_end_matches('.')`); the refactor promised no change in routing.
        let t = table(&[DomainPattern::Exact("a.test".into()), DomainPattern::Any]);
        assert_eq!(
            t.lookup("a.test.."),
            Some(&0),
            "`Host: a.test..` went to a.test's site"
        );
    }
}
