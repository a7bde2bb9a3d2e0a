use std::time::Duration;

use super::*;

mod proxy;
mod tls;

struct Files {
    dir: tempfile::TempDir,
}

impl Files {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("media")).unwrap();
        std::fs::write(dir.path().join("cert.pem"), "").unwrap();
        std::fs::write(dir.path().join("key.pem"), "").unwrap();
        Self { dir }
    }

    fn parse(&self, text: &str) -> Result<Config, ConfigError> {
        parse(text, "test.toml", self.dir.path())
    }

    fn problems(&self, text: &str) -> Vec<Problem> {
        match self.parse(text) {
            Err(ConfigError::Invalid { problems, .. }) => problems,
            other => panic!("expected validation problems, got {other:?}"),
        }
    }
}

/// The first example of SPEC.md, with paths relative to the config file.
const SPEC_EXAMPLE: &str = r#"
listen = "0.0.0.0:443"
workers = 8
root = "media"

[[sites]]
domain = "media.example.com"
root = "media"
[sites.protocols]
h1 = true
h2 = true
h3 = true
[sites.tls]
cert = "cert.pem"
key = "key.pem"

[runtime.settings]
h2_tls_write_buffer_bytes = "131072"
proxy_h2_tls_max_send_buffer_bytes = "131072"
proxy_h2_tls_connection_send_buffer_bytes = "33554432"
"#;

#[test]
fn the_spec_example_is_accepted() {
    let f = Files::new();
    let config = f.parse(SPEC_EXAMPLE).unwrap();
    assert_eq!(config.listen, "0.0.0.0:443".parse().unwrap());
    assert_eq!(config.workers, 8);
    assert_eq!(
        config.sites.len(),
        2,
        "the named site plus the top-level catch-all"
    );
    assert_eq!(
        config.sites[0].domain,
        DomainPattern::Exact("media.example.com".into())
    );
    assert_eq!(config.sites[1].domain, DomainPattern::Any);
    assert_eq!(config.default_site(), 1);
    assert_eq!(config.h2.tls_write_buffer_bytes, 131_072);
    assert_eq!(config.proxy_h2.tls_connection_send_buffer_bytes, 33_554_432);
    assert_eq!(config.kernel.ktls, Policy::Auto);
    assert!(matches!(&config.sites[0].serve, Serve::Files(root) if root.is_absolute()));
}

#[test]
fn every_problem_is_reported_at_once() {
    let f = Files::new();
    let text = r#"
listen = "nowhere"
workers = 0
[[sites]]
domain = "bad_name!"
root = "media"
[[sites]]
domain = "ok.example"
root = "missing-dir"
[runtime.settings]
h2_max_frame_size_bytes = "1"
"#;
    let keys: Vec<String> = f.problems(text).into_iter().map(|p| p.key).collect();
    for key in [
        "listen",
        "workers",
        "sites[0].domain",
        "sites[1].root",
        "sites[1].tls",
        "runtime.settings.h2_max_frame_size_bytes",
    ] {
        assert!(keys.iter().any(|k| k == key), "{key} missing from {keys:?}");
    }
}

#[test]
fn parse_errors_carry_line_and_column() {
    let f = Files::new();
    let err = f
        .parse("listen = \"127.0.0.1:1\"\nroot = \"media\"\nbogus = 1\n")
        .unwrap_err();
    let text = err.to_string();
    assert!(text.starts_with("test.toml: "), "{text}");
    assert!(
        text.contains("line 3, column 1") && text.contains("bogus"),
        "{text}"
    );
}

#[test]
fn wildcards_and_case() {
    let f = Files::new();
    let text = r#"
[tls]
cert = "cert.pem"
key = "key.pem"
[[sites]]
domain = "*.Example.COM"
root = "media"
"#;
    let config = f.parse(text).unwrap();
    let d = &config.sites[0].domain;
    assert_eq!(*d, DomainPattern::Wildcard(".example.com".into()));
    assert!(d.matches("a.example.com") && d.matches("A.B.EXAMPLE.com"));
    assert!(!d.matches("example.com") && !d.matches("aexample.com"));
}

#[test]
fn protocols_and_reverse_proxy() {
    let f = Files::new();
    let base = "root = \"media\"\n[tls]\ncert = \"cert.pem\"\nkey = \"key.pem\"\n";
    let problems = f.problems(&format!(
        "{base}[protocols]\nh1 = false\nh2 = false\nh3 = false\n"
    ));
    assert_eq!(problems[0].key, "protocols");
    let problems = f.problems(&format!(
        "{base}[reverse_proxy]\nenabled = true\ntls_termination = false\n"
    ));
    let keys: Vec<&str> = problems.iter().map(|p| p.key.as_str()).collect();
    assert_eq!(keys, ["reverse_proxy.udp_upstream", "reverse_proxy.routes"]);
    assert!(f.parse(base).is_ok());
}

#[test]
fn builtin_default_serves_a_directory_on_loopback() {
    let f = Files::new();
    let config = builtin_default(f.dir.path()).unwrap();
    assert_eq!(config.listen, "127.0.0.1:8443".parse().unwrap());
    assert!(matches!(config.sites[0].tls, TlsSource::SelfSigned { .. }));
    assert!(builtin_default(&f.dir.path().join("nope")).is_err());
}

#[test]
fn h3_settings() {
    let f = Files::new();
    let base = "root = \"media\"\n[tls]\ncert = \"cert.pem\"\nkey = \"key.pem\"\n[runtime.settings]\n";
    let config = f
        .parse(&format!(
            "{base}h3_gso = \"0\"\nh3_mtu_upper_bound_bytes = \"9000\"\nh3_send_window_bytes = \"1048576\"\nh3_retry = \"1\"\nh3_bbr_switch_bytes = \"0\"\nh3_send_batch_delay_us = \"250\"\nh3_initial_window_packets = \"10\"\n"
        ))
        .unwrap();
    assert_eq!(config.h3.initial_window_packets, 10);
    assert_eq!(f.parse(base).unwrap().h3.initial_window_packets, 32);
    assert_eq!(config.h3.send_batch_delay_us, 250);
    assert_eq!(f.parse(base).unwrap().h3.send_batch_delay_us, 0);
    assert!(!config.h3.gso);
    assert!(config.h3.always_retry);
    assert_eq!(config.h3.mtu_upper_bound_bytes, MtuBound::Fixed(9000));
    assert_eq!(config.h3.send_window_bytes, 1 << 20);
    assert_eq!(config.h3.bbr_switch_bytes, 0);
    let problems = f.problems(&format!(
        "{base}h3_gso = \"2\"\nh3_mtu_upper_bound_bytes = \"70000\"\nh3_send_batch_delay_us = \"1001\"\n\
         h3_initial_window_packets = \"9\"\n"
    ));
    assert_eq!(
        problems[1].to_string(),
        "`runtime.settings.h3_initial_window_packets`: `9` is not a whole number from 10 to 200 \
         (fix: write it as a quoted number, e.g. \"32\")"
    );
    assert_eq!(
        f.problems(&format!("{base}h3_initial_window_packets = \"201\"\n"))[0].key,
        "runtime.settings.h3_initial_window_packets"
    );
    assert_eq!(
        problems[2].to_string(),
        "`runtime.settings.h3_mtu_upper_bound_bytes`: `70000` is not \"auto\" or a whole number \
         from 1200 to 65527 (fix: write \"auto\" or a quoted number, e.g. \"1200\")"
    );
    let keys: Vec<&str> = problems.iter().map(|p| p.key.as_str()).collect();
    assert_eq!(
        keys,
        [
            "runtime.settings.h3_gso",
            "runtime.settings.h3_initial_window_packets",
            "runtime.settings.h3_mtu_upper_bound_bytes",
            "runtime.settings.h3_send_batch_delay_us"
        ]
    );
}

/// `h3_mtu_upper_bound_bytes`: "auto" by default (the ceiling follows the route to a
/// client on its link), a number for one ceiling everywhere; "0" is not a way to
/// write "auto".
#[test]
fn h3_mtu_upper_bound_is_auto_or_a_number() {
    let f = Files::new();
    let base = "root = \"media\"\n[tls]\ncert = \"cert.pem\"\nkey = \"key.pem\"\n[runtime.settings]\n";
    assert_eq!(f.parse(base).unwrap().h3.mtu_upper_bound_bytes, MtuBound::Auto);
    for (value, bound) in [
        ("auto", MtuBound::Auto),
        (" auto ", MtuBound::Auto),
        ("1200", MtuBound::Fixed(1200)),
        ("1452", MtuBound::Fixed(1452)),
        ("65527", MtuBound::Fixed(65_527)),
    ] {
        let config = f
            .parse(&format!("{base}h3_mtu_upper_bound_bytes = \"{value}\"\n"))
            .unwrap();
        assert_eq!(config.h3.mtu_upper_bound_bytes, bound, "{value}");
    }
    for value in ["0", "1199", "65528", "Auto", "automatic", ""] {
        let problems = f.problems(&format!("{base}h3_mtu_upper_bound_bytes = \"{value}\"\n"));
        assert_eq!(problems.len(), 1, "{value}: {problems:?}");
        assert!(
            problems[0]
                .to_string()
                .contains("is not \"auto\" or a whole number"),
            "{value}"
        );
    }
}

/// `h3_sockets`: today's one socket by default, "0" for one per worker thread, at
/// most 32 (the index byte and the descriptors a takeover carries).
#[test]
fn h3_sockets_setting() {
    let f = Files::new();
    let base = "root = \"media\"\n[tls]\ncert = \"cert.pem\"\nkey = \"key.pem\"\n";
    let config = f.parse(base).unwrap();
    assert_eq!(config.h3.sockets, 1);
    let with = |v: &str| format!("workers = 4\n{base}[runtime.settings]\nh3_sockets = \"{v}\"\n");
    let config = f.parse(&with("0")).unwrap();
    assert_eq!(crate::h3::sockets_wanted(config.h3.sockets, config.workers), 4);
    let config = f.parse(&with("32")).unwrap();
    assert_eq!(crate::h3::sockets_wanted(config.h3.sockets, config.workers), 32);
    for bad in ["33", "-1", "auto", ""] {
        let problems = f.problems(&with(bad));
        let keys: Vec<&str> = problems.iter().map(|p| p.key.as_str()).collect();
        assert_eq!(keys, ["runtime.settings.h3_sockets"], "{bad:?}");
        assert!(
            problems[0].to_string().contains("from 0 to 32"),
            "{bad:?}: {}",
            problems[0]
        );
    }
}

/// HTTP/3 on more than one socket asks for eBPF (the kernel steers the sockets'
/// datagrams); one socket, or no passthrough, does not.
#[test]
fn more_than_one_h3_socket_wants_ebpf() {
    let f = Files::new();
    let base = "root = \"media\"\n[tls]\ncert = \"cert.pem\"\nkey = \"key.pem\"\n";
    let with = |workers: u32, v: &str| {
        format!("workers = {workers}\n{base}[runtime.settings]\nh3_sockets = \"{v}\"\n")
    };
    assert!(!f.parse(base).unwrap().wants_ebpf());
    assert!(f.parse(&with(1, "2")).unwrap().wants_ebpf());
    assert!(f.parse(&with(4, "0")).unwrap().wants_ebpf());
    assert!(!f.parse(&with(1, "0")).unwrap().wants_ebpf());
    assert!(!f.parse(&with(4, "1")).unwrap().wants_ebpf());
}

const PROXY_BASE: &str = r#"
listen = "127.0.0.1:8443"
[reverse_proxy]
enabled = true
tls_termination = true
[reverse_proxy.tls]
cert = "cert.pem"
key = "key.pem"
"#;

#[test]
fn webtransport_endpoints_are_validated() {
    let f = Files::new();
    let site = |wt: &str| {
        format!(
            "[[sites]]\ndomain = \"a.test\"\nroot = \"media\"\n[sites.tls]\ncert = \"cert.pem\"\nkey = \"key.pem\"\n[sites.webtransport]\n{wt}\n"
        )
    };
    let config = f
        .parse(&site(
            "allowed_origins = [\"https://app.test\"]\nmodes = [\"echo\"]\nmax_sessions = 3",
        ))
        .unwrap();
    let wt = config.sites[0].webtransport.as_ref().unwrap();
    assert_eq!(wt.path, "/webtransport");
    assert_eq!((wt.max_sessions, wt.modes.clone()), (3, vec![WtMode::Echo]));
    assert_eq!(wt.idle_timeout, Duration::from_secs(30));

    let keys = |wt: &str| -> Vec<String> { f.problems(&site(wt)).into_iter().map(|p| p.key).collect() };
    assert_eq!(keys(""), ["sites[0].webtransport.allowed_origins"]);
    assert_eq!(
        keys("allowed_origins = [\"https://app.test/x\"]"),
        ["sites[0].webtransport.allowed_origins"]
    );
    assert_eq!(
        keys("allowed_origins = [\"*\"]\npath = \"wt?x\""),
        ["sites[0].webtransport.path"]
    );
    assert_eq!(
        keys("allowed_origins = [\"*\"]\nmax_datagram_bytes = 70000\nmax_sessions = 0"),
        [
            "sites[0].webtransport.max_sessions",
            "sites[0].webtransport.max_datagram_bytes"
        ]
    );
    assert_eq!(
        keys("allowed_origins = [\"*\"]\nmodes = []"),
        ["sites[0].webtransport.modes"]
    );
    // A typo is an error, not a silently weaker limit.
    assert!(matches!(
        f.parse(&site("allowed_origins = [\"*\"]\nmax_sesions = 1")),
        Err(ConfigError::Parse { .. })
    ));
    let no_http23 = format!(
        "{}[sites.protocols]\nh1 = true\nh2 = false\nh3 = false\n",
        "[[sites]]\ndomain = \"a.test\"\nroot = \"media\"\n[sites.tls]\ncert = \"cert.pem\"\nkey = \"key.pem\"\n[sites.webtransport]\nallowed_origins = [\"*\"]\n"
    );
    assert_eq!(
        f.problems(&no_http23)
            .into_iter()
            .map(|p| p.key)
            .collect::<Vec<_>>(),
        ["sites[0].webtransport"]
    );
}

/// The messages `webship check` prints for `[runtime.settings]`, pinned whole, so a
/// change in how the keys are described cannot change what an operator reads.
#[test]
fn runtime_setting_messages_are_exact() {
    let f = Files::new();
    let text = "root = \"media\"\n[tls]\ncert = \"cert.pem\"\nkey = \"key.pem\"\n[runtime.settings]\n\
                h2_tls_write_bufer_bytes = \"131072\"\nh3_gso = \"2\"\n\
                proxy_h2_tls_connection_send_buffer_bytes = \"lots\"\n";
    let expected = "test.toml: 3 problem(s):\n  \
        - `runtime.settings.h2_tls_write_bufer_bytes`: unknown setting (fix: use one of: \
        h2_tls_write_buffer_bytes, h2_initial_stream_window_bytes, h2_initial_connection_window_bytes, \
        h2_max_frame_size_bytes, h2_max_concurrent_streams, h2_max_send_buffer_bytes, h3_send_window_bytes, \
        h3_stream_receive_window_bytes, h3_receive_window_bytes, h3_max_concurrent_streams, \
        h3_mtu_upper_bound_bytes, h3_gso, h3_bbr_switch_bytes, h3_initial_window_packets, h3_retry, h3_sockets, h3_send_batch_delay_us, proxy_h2_tls_max_send_buffer_bytes, \
        proxy_h2_tls_connection_send_buffer_bytes)\n  \
        - `runtime.settings.h3_gso`: `2` is not a whole number from 0 to 1 \
        (fix: write it as a quoted number, e.g. \"1\")\n  \
        - `runtime.settings.proxy_h2_tls_connection_send_buffer_bytes`: `lots` is not a whole number \
        from 16384 to 4294967296 (fix: write it as a quoted number, e.g. \"33554432\")";
    assert_eq!(f.parse(text).unwrap_err().to_string(), expected);
}

/// Each key's range must fit the field it sets: both ends survive a round trip, and
/// the default lies inside.
#[test]
fn every_range_fits_its_field() {
    let names: Vec<&str> = settings::names().collect();
    let mut unique = names.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), names.len(), "a key is listed twice: {names:?}");
    for name in names {
        let setting = settings::find(name).unwrap();
        for n in [*setting.range.start(), *setting.range.end()] {
            let mut tuned = settings::Tuned::default();
            setting.set(&mut tuned, n);
            assert_eq!(setting.get(&tuned), n, "{name} = {n} does not fit its field");
        }
        let default = setting.default_value();
        assert!(
            setting.range.contains(&default) || setting.word.is_some_and(|(_, n)| n == default),
            "{name}: the default is out of range"
        );
        if let Some((word, n)) = setting.word {
            assert!(!setting.range.contains(&n), "{name}: {word} is also a number");
            let mut tuned = settings::Tuned::default();
            setting.set(&mut tuned, n);
            assert_eq!(setting.get(&tuned), n, "{name} = {word} does not fit its field");
        }
    }
}

/// The README's `[runtime.settings]` example lists every key with its default, so a
/// key added to the table without documentation fails here.
#[test]
fn the_readme_lists_every_setting_with_its_default() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
    let block = readme
        .split_once("[runtime.settings]")
        .and_then(|(_, rest)| rest.split_once("```"))
        .map(|(block, _)| block)
        .expect("README.md has a [runtime.settings] example");
    let documented: Vec<(String, String)> = block
        .lines()
        .filter_map(|line| {
            let (key, rest) = line.split_once(" = \"")?;
            let value = rest.split('"').next()?;
            Some((key.trim().to_owned(), value.to_owned()))
        })
        .collect();
    let table: Vec<(String, String)> = settings::names()
        .map(|name| {
            let default = settings::find(name).unwrap().default_text();
            (name.to_owned(), default)
        })
        .collect();
    assert_eq!(documented, table);
}

#[test]
fn dotfiles_default_to_deny_and_sites_inherit_the_top_level() {
    let f = Files::new();
    let config = f.parse(SPEC_EXAMPLE).unwrap();
    assert!(config.sites.iter().all(|s| s.dotfiles == Dotfiles::Deny));
    let text = SPEC_EXAMPLE.replace("workers = 8\n", "workers = 8\ndotfiles = \"allow\"\n");
    let config = f.parse(&text).unwrap();
    assert!(config.sites.iter().all(|s| s.dotfiles == Dotfiles::Allow));
    let text = SPEC_EXAMPLE.replace("[sites.protocols]", "dotfiles = \"allow\"\n[sites.protocols]");
    let config = f.parse(&text).unwrap();
    assert_eq!(config.sites[0].dotfiles, Dotfiles::Allow);
    assert_eq!(config.sites[1].dotfiles, Dotfiles::Deny);
    let text = SPEC_EXAMPLE.replace("[sites.protocols]", "dotfiles = \"hide\"\n[sites.protocols]");
    match f.parse(&text) {
        Err(ConfigError::Parse { message, .. }) => {
            assert!(message.contains("deny") && message.contains("allow"), "{message}")
        }
        other => panic!("expected a parse error, got {other:?}"),
    }
}

#[test]
fn user_and_group_are_account_names() {
    let f = Files::new();
    let config = f.parse(SPEC_EXAMPLE).unwrap();
    assert_eq!((config.user, config.group), (None, None));
    let text = SPEC_EXAMPLE.replace(
        "workers = 8\n",
        "workers = 8\nuser = \"webship\"\ngroup = \"www\"\n",
    );
    let config = f.parse(&text).unwrap();
    assert_eq!(config.user.as_deref(), Some("webship"));
    assert_eq!(config.group.as_deref(), Some("www"));
    let text = SPEC_EXAMPLE.replace("workers = 8\n", "workers = 8\nuser = \"\"\ngroup = \"a b\"\n");
    let keys: Vec<String> = f.problems(&text).into_iter().map(|p| p.key).collect();
    assert_eq!(keys, ["user", "group"]);
    let text = SPEC_EXAMPLE.replace("workers = 8\n", "workers = 8\ngroup = \"www\"\n");
    let problems = f.problems(&text);
    assert_eq!(problems[0].key, "group");
    assert!(problems[0].fix.contains("user"), "{problems:?}");
}

#[test]
fn access_log_keys_and_per_site_sampling() {
    let f = Files::new();
    let site = |log: &str| {
        format!("[[sites]]\ndomain = \"a.example\"\nroot = \"media\"\n{log}[sites.tls]\ncert = \"cert.pem\"\nkey = \"key.pem\"\n")
    };
    let off = f.parse(&site("")).unwrap();
    assert_eq!(off.access_log, AccessLog::default());
    assert_eq!(off.access_log.format, AccessFormat::Combined);
    assert_eq!(off.sites[0].access_sample, None);

    let on = f
        .parse(&format!(
            "[log]\naccess = true\naccess_format = \"json\"\naccess_path = \"access.log\"\naccess_sample = 0.5\n{}",
            site("[sites.log]\naccess_sample = 0.1\n")
        ))
        .unwrap();
    assert!(on.access_log.enabled);
    assert_eq!(on.access_log.format, AccessFormat::Json);
    assert_eq!(on.access_log.path, Some(f.dir.path().join("access.log")));
    assert_eq!(on.access_log.sample, 0.5);
    assert_eq!(on.sites[0].access_sample, Some(0.1));
    let quiet = f
        .parse(&format!(
            "[log]\naccess = true\n{}",
            site("[sites.log]\naccess = false\n")
        ))
        .unwrap();
    assert_eq!(quiet.sites[0].access_sample, Some(0.0));

    let unknown = f.parse(&format!("[log]\naccess_format = \"clf\"\n{}", site("")));
    assert!(matches!(unknown, Err(ConfigError::Parse { .. })), "{unknown:?}");
    let problems = f.problems(&format!(
        "[log]\naccess_path = \"nowhere/access.log\"\naccess_sample = 1.5\n{}",
        site("[sites.log]\naccess = false\naccess_sample = 0.2\n")
    ));
    let keys: Vec<&str> = problems.iter().map(|p| p.key.as_str()).collect();
    assert_eq!(
        keys,
        [
            "log.access_sample",
            "log.access_path",
            "sites[0].log.access_sample"
        ],
        "{problems:?}"
    );
    assert!(
        problems[1].problem.contains("folder that does not exist"),
        "{problems:?}"
    );
}

#[test]
fn the_admin_listener_stays_on_loopback_unless_allowed_with_a_token() {
    let f = Files::new();
    let base =
        "listen = \"127.0.0.1:8443\"\nroot = \"media\"\n[tls]\ncert = \"cert.pem\"\nkey = \"key.pem\"\n";
    let config = f
        .parse(&format!("{base}[admin]\nlisten = \"127.0.0.1:9901\"\n"))
        .unwrap();
    assert_eq!(
        config.admin,
        Some(Admin {
            listen: "127.0.0.1:9901".parse().unwrap(),
            token_file: None,
        })
    );
    assert_eq!(f.parse(base).unwrap().admin, None);

    let remote = f.problems(&format!("{base}[admin]\nlisten = \"0.0.0.0:9901\"\n"));
    assert_eq!(remote.len(), 1, "{remote:?}");
    assert_eq!(remote[0].key, "admin.listen");
    assert!(remote[0].problem.contains("not a loopback address"), "{remote:?}");

    let no_token = f.problems(&format!(
        "{base}[admin]\nlisten = \"0.0.0.0:9901\"\nallow_remote = true\n"
    ));
    assert_eq!(no_token.len(), 1, "{no_token:?}");
    assert_eq!(no_token[0].key, "admin.allow_remote");

    std::fs::write(f.dir.path().join("short"), "abc\n").unwrap();
    std::fs::write(f.dir.path().join("token"), "0123456789abcdef0123\n").unwrap();
    let short = f.problems(&format!(
        "{base}[admin]\nlisten = \"0.0.0.0:9901\"\nallow_remote = true\ntoken_file = \"short\"\n"
    ));
    assert_eq!(short.len(), 1, "{short:?}");
    assert_eq!(short[0].key, "admin.token_file");
    let missing = f.problems(&format!(
        "{base}[admin]\nlisten = \"127.0.0.1:9901\"\ntoken_file = \"nope\"\n"
    ));
    assert_eq!(missing[0].key, "admin.token_file");
    let allowed = f
        .parse(&format!(
            "{base}[admin]\nlisten = \"0.0.0.0:9901\"\nallow_remote = true\ntoken_file = \"token\"\n"
        ))
        .unwrap();
    let token_file = allowed.admin.unwrap().token_file.unwrap();
    assert_eq!(read_admin_token(&token_file).unwrap(), "0123456789abcdef0123");

    let same_port = f.problems(&format!("{base}[admin]\nlisten = \"127.0.0.1:8443\"\n"));
    assert!(
        same_port[0].problem.contains("the port `listen` serves on"),
        "{same_port:?}"
    );
    let typo = f.parse(&format!(
        "{base}[admin]\nlisten = \"127.0.0.1:9901\"\ntoken = \"x\"\n"
    ));
    assert!(typo.is_err(), "unknown keys are errors");
}
