//! The reverse proxy's keys: routes, timeouts, caps, trusted proxies, passthrough
//! and its engines, PROXY protocol.

use super::*;

#[test]
fn the_spec_proxy_example_becomes_a_proxy_site() {
    let f = Files::new();
    let config = f
        .parse(&format!(
            "{PROXY_BASE}[[reverse_proxy.routes]]\ndomain = \"media.example.com\"\npath_prefix = \"/\"\nupstreams = [\"10.0.0.20:8080\"]\n[[reverse_proxy.routes]]\ndomain = \"media.example.com\"\npath_prefix = \"/api/\"\nupstreams = [\"10.0.0.21:8080\", \"[::1]:9000\"]\nupstream_protocol = \"h2c\"\n"
        ))
        .unwrap();
    assert_eq!(config.sites.len(), 1);
    let Serve::Proxy(routes) = &config.sites[0].serve else {
        panic!("not a proxy site");
    };
    assert_eq!(routes[0].path_prefix, "/api/", "longest prefix first");
    assert_eq!(routes[0].upstreams.len(), 2);
    assert_eq!(routes[0].upstream_protocol, UpstreamProtocol::H2c);
    assert_eq!(routes[1].path_prefix, "/");
}

#[test]
fn bad_routes_are_named() {
    let f = Files::new();
    let route =
        |body: &str| format!("{PROXY_BASE}[[reverse_proxy.routes]]\ndomain = \"a.example\"\n{body}\n");
    let keys = |text: String| -> Vec<String> { f.problems(&text).into_iter().map(|p| p.key).collect() };
    assert_eq!(
        keys(route("upstreams = []")),
        ["reverse_proxy.routes[0].upstreams"]
    );
    assert_eq!(
        keys(route("upstreams = [\"backend:80\"]")),
        ["reverse_proxy.routes[0].upstreams[0]"]
    );
    assert_eq!(
        keys(route("path_prefix = \"api\"\nupstreams = [\"127.0.0.1:1\"]")),
        ["reverse_proxy.routes[0].path_prefix"]
    );
    assert_eq!(
        keys(route("upstreams = [\"127.0.0.1:1\"]\nupstream_protocol = \"h2\"")),
        ["reverse_proxy.routes[0].upstream_ca"]
    );
    let duplicate = format!(
        "{}[[reverse_proxy.routes]]\ndomain = \"a.example\"\nupstreams = [\"127.0.0.1:2\"]\n",
        route("upstreams = [\"127.0.0.1:1\"]")
    );
    assert_eq!(keys(duplicate), ["reverse_proxy.routes[1].path_prefix"]);
    let both = format!(
        "{}[[sites]]\ndomain = \"a.example\"\nroot = \"media\"\n[sites.tls]\ncert = \"cert.pem\"\nkey = \"key.pem\"\n",
        route("upstreams = [\"127.0.0.1:1\"]")
    );
    assert_eq!(keys(both), ["reverse_proxy.routes[0].domain"]);
    assert_eq!(keys(PROXY_BASE.to_owned()), ["reverse_proxy.routes"]);
}

#[test]
fn proxy_timeouts_caps_and_trusted_proxies() {
    let f = Files::new();
    let with = |proxy: &str, route: &str| {
        format!(
            "listen = \"127.0.0.1:8443\"\n[reverse_proxy]\n{proxy}\n[reverse_proxy.tls]\ncert = \"cert.pem\"\nkey = \"key.pem\"\n[[reverse_proxy.routes]]\ndomain = \"a.example\"\nupstreams = [\"127.0.0.1:1\"]\n{route}\n"
        )
    };
    let route_of = |config: Config| match &config.sites[0].serve {
        Serve::Proxy(routes) => routes[0].clone(),
        Serve::Files(_) => panic!("not a proxy site"),
    };
    // Defaults: nginx's 60 s, HAProxy's queue timeout = the connect timeout.
    let r = route_of(f.parse(&with("", "")).unwrap());
    assert_eq!(
        (
            r.connect_timeout,
            r.response_timeout,
            r.body_idle_timeout,
            r.queue_timeout
        ),
        (
            Duration::from_secs(3),
            Duration::from_secs(60),
            Duration::from_secs(60),
            Duration::from_secs(3)
        )
    );
    assert_eq!((r.max_connections_per_upstream, r.trusted_proxies.len()), (64, 0));
    // The older key sets both timeouts.
    let r = route_of(
        f.parse(&with("", "read_timeout_secs = 7\nconnect_timeout_ms = 500"))
            .unwrap(),
    );
    assert_eq!(
        (r.response_timeout, r.body_idle_timeout, r.queue_timeout),
        (
            Duration::from_secs(7),
            Duration::from_secs(7),
            Duration::from_millis(500)
        )
    );
    let r = route_of(
        f.parse(&with(
            "trusted_proxies = [\"10.0.0.0/8\", \"::1\"]",
            "response_timeout_secs = 5\nbody_idle_timeout_secs = 9\nmax_connections_per_upstream = 2\nqueue_timeout_ms = 100",
        ))
        .unwrap(),
    );
    assert_eq!(
        (
            r.response_timeout,
            r.body_idle_timeout,
            r.max_connections_per_upstream,
            r.queue_timeout
        ),
        (
            Duration::from_secs(5),
            Duration::from_secs(9),
            2,
            Duration::from_millis(100)
        )
    );
    assert!(r.trusted_proxies[0].contains("10.1.2.3".parse().unwrap()));
    assert!(r.trusted_proxies[0].contains("::ffff:10.1.2.3".parse().unwrap()));
    assert!(!r.trusted_proxies[0].contains("11.0.0.1".parse().unwrap()));
    assert!(r.trusted_proxies[1].contains("::1".parse().unwrap()));

    let keys = |text: String| -> Vec<String> { f.problems(&text).into_iter().map(|p| p.key).collect() };
    assert_eq!(
        keys(with("", "read_timeout_secs = 5\nresponse_timeout_secs = 5")),
        ["reverse_proxy.routes[0].read_timeout_secs"]
    );
    assert_eq!(
        keys(with("", "max_connections_per_upstream = 0")),
        ["reverse_proxy.routes[0].max_connections_per_upstream"]
    );
    assert_eq!(
        keys(with("", "body_idle_timeout_secs = 0")),
        ["reverse_proxy.routes[0].body_idle_timeout_secs"]
    );
    assert_eq!(
        keys(with(
            "trusted_proxies = [\"10.0.0.1/8\", \"10.0.0.0/33\", \"nope\"]",
            ""
        )),
        [
            "reverse_proxy.trusted_proxies[0]",
            "reverse_proxy.trusted_proxies[1]",
            "reverse_proxy.trusted_proxies[2]"
        ]
    );
    assert_eq!(
        keys(with("", "path_prefix = \"/a/../b/\"\ndeny_paths = [\"/%61dmin*\", \"admin\", \"/x//y\", \"/a*b*\", \"*.php\", \"/ok*\"]")),
        [
            "reverse_proxy.routes[0].path_prefix",
            "reverse_proxy.routes[0].deny_paths[0]",
            "reverse_proxy.routes[0].deny_paths[1]",
            "reverse_proxy.routes[0].deny_paths[2]",
            "reverse_proxy.routes[0].deny_paths[3]"
        ]
    );
    assert_eq!(
        keys(with(
            "",
            "path_prefix = \"/café/\"\ndeny_paths = [\"*/admin*\", \"/a;b\", \"/caf%C3%A9*\", \"/.*\", \"*/admin\", \"/@x*\", \"/a:b\", \"*\", \"/x;*\"]"
        )),
        [
            "reverse_proxy.routes[0].deny_paths[0]",
            "reverse_proxy.routes[0].deny_paths[1]",
            "reverse_proxy.routes[0].deny_paths[2]",
            "reverse_proxy.routes[0].deny_paths[8]"
        ]
    );
    assert_eq!(
        keys(with("", "path_prefix = \"/api;v=1/\"")),
        ["reverse_proxy.routes[0].path_prefix"]
    );
    let passthrough = "listen = \"127.0.0.1:8443\"\n[reverse_proxy]\ntls_termination = false\ntrusted_proxies = [\"10.0.0.0/8\"]\n[reverse_proxy.protocols]\nh3 = false\n[[reverse_proxy.routes]]\ndomain = \"a.example\"\nupstreams = [\"127.0.0.1:1\"]\nqueue_timeout_ms = 5\n";
    assert_eq!(
        keys(passthrough.to_owned()),
        [
            "reverse_proxy.trusted_proxies",
            "reverse_proxy.routes[0].queue_timeout_ms"
        ]
    );
}

#[test]
fn passthrough_routes_by_sni_alone() {
    let f = Files::new();
    let base = "listen = \"127.0.0.1:8443\"\n[reverse_proxy]\ntls_termination = false\n[reverse_proxy.protocols]\nh3 = false\n";
    let config = f
        .parse(&format!(
            "{base}[[reverse_proxy.routes]]\ndomain = \"*.example.com\"\nupstreams = [\"10.0.0.20:443\"]\n"
        ))
        .unwrap();
    assert!(config.sites.is_empty());
    assert_eq!(config.passthrough.len(), 1);
    assert_eq!(
        config.passthrough[0].domain,
        DomainPattern::Wildcard(".example.com".into())
    );
    let problems = f.problems(&format!(
        "{base}[reverse_proxy.tls]\ncert = \"cert.pem\"\nkey = \"key.pem\"\n[[reverse_proxy.routes]]\ndomain = \"a.example\"\npath_prefix = \"/api/\"\nmax_body_bytes = 10\nupstreams = [\"10.0.0.20:443\"]\n"
    ));
    let keys: Vec<&str> = problems.iter().map(|p| p.key.as_str()).collect();
    assert_eq!(
        keys,
        [
            "reverse_proxy.tls",
            "reverse_proxy.routes[0].path_prefix",
            "reverse_proxy.routes[0].max_body_bytes"
        ]
    );
}

#[test]
fn passthrough_engine_ebpf_and_udp_keys() {
    let f = Files::new();
    let route = "[[reverse_proxy.routes]]\ndomain = \"a.example\"\nupstreams = [\"10.0.0.20:443\"]\n";
    let pass = |extra: &str, h3: bool| {
        format!(
            "listen = \"127.0.0.1:8443\"\n[reverse_proxy]\ntls_termination = false\n{extra}[reverse_proxy.protocols]\nh3 = {h3}\n{route}"
        )
    };
    let config = f
        .parse(&pass(
            "passthrough_engine = \"sockmap\"\nudp_upstream = \"127.0.0.1:9443\"\n",
            true,
        ))
        .unwrap();
    assert_eq!(config.passthrough_engine, Engine::Sockmap);
    // Naming the eBPF engine makes eBPF required.
    assert_eq!(config.kernel.ebpf, Policy::Required);
    let udp = config.passthrough_udp.unwrap();
    assert_eq!(udp.upstream, "127.0.0.1:9443".parse().unwrap());
    assert_eq!(udp.flow_idle, Duration::from_secs(30));
    assert_eq!(
        f.parse(&pass("", false)).unwrap().passthrough_engine,
        Engine::Auto
    );

    let keys = |text: String| -> Vec<String> { f.problems(&text).into_iter().map(|p| p.key).collect() };
    assert_eq!(keys(pass("", true)), ["reverse_proxy.udp_upstream"]);
    assert_eq!(
        keys(pass("udp_upstream = \"127.0.0.1:9443\"\n", false)),
        ["reverse_proxy.udp_upstream"]
    );
    assert_eq!(
        keys(pass("udp_upstream = \"origin:443\"\n", true)),
        ["reverse_proxy.udp_upstream"]
    );
    assert_eq!(
        keys(pass("udp_flow_idle_secs = 5\n", false)),
        ["reverse_proxy.udp_flow_idle_secs"]
    );
    // The tunnel idle timeout: nginx stream's ten minutes unless set, 1 s to a day.
    assert_eq!(udp.max_flows_per_address, 64);
    assert_eq!(
        f.parse(&pass("", false)).unwrap().passthrough_idle_timeout,
        Duration::from_secs(600)
    );
    assert_eq!(
        f.parse(&pass("passthrough_idle_timeout_secs = 5\n", false))
            .unwrap()
            .passthrough_idle_timeout,
        Duration::from_secs(5)
    );
    assert_eq!(
        keys(pass("passthrough_idle_timeout_secs = 0\n", false)),
        ["reverse_proxy.passthrough_idle_timeout_secs"]
    );
    assert_eq!(
        keys(pass(
            "udp_upstream = \"127.0.0.1:9443\"\nudp_max_flows_per_address = 0\n",
            true
        )),
        ["reverse_proxy.udp_max_flows_per_address"]
    );
    match f.parse(&pass("passthrough_engine = \"turbo\"\n", false)) {
        Err(ConfigError::Parse { message, .. }) => {
            assert!(
                message.contains("turbo") && message.contains("sockmap"),
                "{message}"
            )
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        keys(format!(
            "{}[kernel]\nebpf = \"off\"\n",
            pass("passthrough_engine = \"sockmap\"\n", false)
        )),
        ["reverse_proxy.passthrough_engine"]
    );
    assert_eq!(
        keys(format!(
            "{}[kernel]\nbpf_pin_dir = \"relative\"\n",
            pass("", false)
        )),
        ["kernel.bpf_pin_dir"]
    );
    // TCP health is off unless asked for; requiring it requires eBPF (`auto`
    // without eBPF is preflight's to report).
    assert_eq!(f.parse(&pass("", false)).unwrap().kernel.tcp_health, Policy::Off);
    assert_eq!(
        keys(format!(
            "{}[kernel]\nebpf = \"off\"\ntcp_health = \"required\"\n",
            pass("", false)
        )),
        ["kernel.tcp_health"]
    );
    f.parse(&format!(
        "{}[kernel]\nebpf = \"off\"\ntcp_health = \"auto\"\n",
        pass("", false)
    ))
    .unwrap();
    let config = f
        .parse(&format!(
            "{}[kernel]\ntcp_health = \"required\"\n",
            pass("", false)
        ))
        .unwrap();
    assert_eq!(config.kernel.tcp_health, Policy::Required);
    // The eBPF UDP redirect needs loopback on both ends; naming it requires eBPF.
    let config = f
        .parse(&pass(
            "udp_upstream = \"127.0.0.2:9443\"\nudp_engine = \"ebpf\"\n",
            true,
        ))
        .unwrap();
    assert_eq!(config.passthrough_udp.unwrap().engine, UdpEngine::Ebpf);
    assert_eq!(config.kernel.ebpf, Policy::Required);
    assert_eq!(
        keys(pass(
            "udp_upstream = \"10.0.0.20:443\"\nudp_engine = \"ebpf\"\n",
            true
        )),
        ["reverse_proxy.udp_engine"]
    );
    assert_eq!(
        keys(pass("udp_engine = \"userspace\"\n", false)),
        ["reverse_proxy.udp_engine"]
    );
    assert!(UdpEngine::ebpf_applies(
        "127.0.0.1:443".parse().unwrap(),
        "127.0.0.5:8443".parse().unwrap()
    ));
    assert!(!UdpEngine::ebpf_applies(
        "[::1]:443".parse().unwrap(),
        "127.0.0.1:8443".parse().unwrap()
    ));
    // Termination does not splice.
    let terminate = "listen = \"127.0.0.1:8443\"\n[reverse_proxy]\npassthrough_engine = \"copy\"\n[reverse_proxy.tls]\ncert = \"cert.pem\"\nkey = \"key.pem\"\n[[reverse_proxy.routes]]\ndomain = \"a.example\"\nupstreams = [\"10.0.0.20:80\"]\n";
    assert_eq!(keys(terminate.into()), ["reverse_proxy.passthrough_engine"]);
}

#[test]
fn proxy_protocol_keys() {
    let f = Files::new();
    let passthrough = |top: &str, route: &str| {
        format!(
            "listen = \"127.0.0.1:8443\"\n{top}\n[reverse_proxy]\ntls_termination = false\n[reverse_proxy.protocols]\nh3 = false\n[[reverse_proxy.routes]]\ndomain = \"a.example\"\nupstreams = [\"127.0.0.1:1\"]\n{route}\n"
        )
    };
    let config = f.parse(&passthrough("", "")).unwrap();
    assert!(config.accept_proxy_protocol.is_empty());
    assert_eq!(config.passthrough[0].proxy_protocol, None);
    let config = f
        .parse(&passthrough(
            "accept_proxy_protocol = [\"10.0.0.0/8\", \"127.0.0.2\", \"2001:db8::/32\"]",
            "proxy_protocol = \"v2\"",
        ))
        .unwrap();
    let listed = &config.accept_proxy_protocol;
    assert!(
        listed[0].contains("10.9.8.7".parse().unwrap()) && listed[1].contains("127.0.0.2".parse().unwrap())
    );
    assert!(!listed.iter().any(|n| n.contains("127.0.0.1".parse().unwrap())));
    assert_eq!(config.passthrough[0].proxy_protocol, Some(ProxyProtocol::V2));
    let config = f.parse(&passthrough("", "proxy_protocol = \"v1\"")).unwrap();
    assert_eq!(config.passthrough[0].proxy_protocol, Some(ProxyProtocol::V1));
    let config = f.parse(&passthrough("", "proxy_protocol = \"off\"")).unwrap();
    assert_eq!(config.passthrough[0].proxy_protocol, None);

    let keys = |text: String| -> Vec<String> { f.problems(&text).into_iter().map(|p| p.key).collect() };
    assert_eq!(
        keys(passthrough(
            "accept_proxy_protocol = [\"10.0.0.1/8\", \"nope\", \"10.0.0.0/8\"]",
            "proxy_protocol = \"v3\""
        )),
        [
            "accept_proxy_protocol[0]",
            "accept_proxy_protocol[1]",
            "reverse_proxy.routes[0].proxy_protocol"
        ]
    );
    // A terminated route's upstream speaks HTTP: it gets forwarding fields instead.
    let terminated = "listen = \"127.0.0.1:8443\"\n[reverse_proxy]\n[reverse_proxy.tls]\ncert = \"cert.pem\"\nkey = \"key.pem\"\n[[reverse_proxy.routes]]\ndomain = \"a.example\"\nupstreams = [\"127.0.0.1:1\"]\nproxy_protocol = \"v2\"\n";
    let problems = f.problems(terminated);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].key, "reverse_proxy.routes[0].proxy_protocol");
    assert!(problems[0].fix.contains("tls_termination = false"));
}
