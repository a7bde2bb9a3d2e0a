use super::file::{self, FileKey, MAX_KEYS, SECRET_BYTES};
use super::*;

fn key(not_before: u64, byte: u8) -> FileKey {
    FileKey {
        not_before,
        secret: [byte; SECRET_BYTES],
    }
}

fn from_keys(keys: &[FileKey]) -> Tickets {
    Tickets {
        state: RwLock::new(State {
            set: KeySet::from_file(keys),
            source: Source::File {
                path: PathBuf::from("/nonexistent"),
                stamp: None,
            },
        }),
    }
}

#[test]
fn a_ticket_opens_with_the_set_that_sealed_it_and_with_no_other() {
    let a = from_keys(&[key(100, 1)]);
    let ticket = a.seal(b"resumption state", 200).unwrap();
    assert_ne!(&ticket[ID_BYTES + NONCE_LEN..][..16], b"resumption state");
    assert_eq!(a.open(&ticket).unwrap(), b"resumption state");
    // The same file on another host: same keys, same ids.
    assert_eq!(
        from_keys(&[key(100, 1)]).open(&ticket).unwrap(),
        b"resumption state"
    );
    assert!(from_keys(&[key(100, 2)]).open(&ticket).is_none());
    // Tampered anywhere (id, nonce, body, tag): refused.
    for i in [0, ID_BYTES, ID_BYTES + NONCE_LEN, ticket.len() - 1] {
        let mut bad = ticket.clone();
        bad[i] ^= 1;
        assert!(a.open(&bad).is_none(), "byte {i} flipped still opened");
    }
    assert!(a.open(&ticket[..ID_BYTES + NONCE_LEN + TAG_BYTES - 1]).is_none());
    assert!(a.open(&[]).is_none());
    assert!(a.open(&vec![0; MAX_TICKET_BYTES + 1]).is_none());
}

#[test]
fn the_latest_active_key_encrypts_and_every_key_decrypts() {
    // Key 2 waits until 1000: before, key 1 encrypts; after, key 2; both decrypt.
    let set = from_keys(&[key(1000, 2), key(10, 1)]);
    let early = set.seal(b"x", 999).unwrap();
    let late = set.seal(b"y", 1000).unwrap();
    assert_eq!(early[..ID_BYTES], set.read().set.0[1].id);
    assert_eq!(late[..ID_BYTES], set.read().set.0[0].id);
    // A host that does not have key 2 yet still opens what key 1 sealed, not key 2's.
    let old_host = from_keys(&[key(10, 1)]);
    assert!(old_host.open(&early).is_some());
    assert!(old_host.open(&late).is_none());
    assert!(set.open(&early).is_some() && set.open(&late).is_some());
}

#[test]
fn generated_keys_rotate_and_keep_the_previous_one() {
    let t = Tickets::new(None).unwrap();
    let now = unix_now();
    let first = t.seal(b"a", now).unwrap();
    let second = t.seal(b"b", now + ROTATION_SECS).unwrap();
    assert_ne!(
        first[..ID_BYTES],
        second[..ID_BYTES],
        "no new key after a rotation period"
    );
    assert!(t.open(&first).is_some(), "the previous key no longer decrypts");
    let third = t.seal(b"c", now + 2 * ROTATION_SECS).unwrap();
    assert!(t.open(&first).is_none(), "a key two rotations old still decrypts");
    assert!(t.open(&second).is_some() && t.open(&third).is_some());
    assert_eq!(t.read().set.0.len(), 2);
}

#[test]
fn a_reload_without_a_file_keeps_generated_keys() {
    let t = Tickets::new(None).unwrap();
    let ticket = t.seal(b"a", unix_now()).unwrap();
    let prepared = t.prepare(None).unwrap();
    t.install(prepared);
    assert!(t.open(&ticket).is_some());
}

#[test]
fn parse_accepts_what_render_writes_and_nothing_loose() {
    let keys = vec![key(5, 1), key(7, 2)];
    let text = file::render(&keys);
    let mut back = file::parse(&text).unwrap();
    back.sort_by_key(|k| k.not_before);
    assert_eq!(back, keys);
    let hex = "ab".repeat(SECRET_BYTES);
    let cases: &[(String, usize, &str)] = &[
        (String::new(), 1, "header"),
        (format!("webship-ticket-keys v2\nkey 1 {hex}\n"), 1, "must start"),
        (format!("{}\n", file::HEADER), 1, "no `key` line"),
        (
            format!("{}\nkey 1 {}\n", file::HEADER, &hex[2..]),
            2,
            "hex digits",
        ),
        (
            format!("{}\nkey 1 {}zz\n", file::HEADER, &hex[2..]),
            2,
            "hex digits",
        ),
        (format!("{}\nkey x {hex}\n", file::HEADER), 2, "unix seconds"),
        (
            format!("{}\nkey 1 {hex} extra\n", file::HEADER),
            2,
            "three fields",
        ),
        (
            format!("{}\nkee 1 {hex}\n", file::HEADER),
            2,
            "starting with `key`",
        ),
        (
            format!("{}\nkey 1 {hex}\n# c\nkey 2 {hex}\n", file::HEADER),
            4,
            "same secret",
        ),
        (
            format!(
                "{}\nkey 1 {hex}\nkey 1 {}\n",
                file::HEADER,
                "cd".repeat(SECRET_BYTES)
            ),
            3,
            "same `not_before`",
        ),
    ];
    for (text, line, words) in cases {
        let (at, reason) = file::parse(text).unwrap_err();
        assert_eq!((at, reason.contains(words)), (*line, true), "{text:?}: {reason}");
        assert!(
            !reason.contains(&hex[..8]),
            "the error quotes key material: {reason}"
        );
    }
    let many: Vec<FileKey> = (0..=MAX_KEYS as u8).map(|i| key(u64::from(i), i)).collect();
    let (_, reason) = file::parse(&file::render(&many)).unwrap_err();
    assert!(reason.contains("more than"), "{reason}");
}

#[test]
fn read_refuses_a_file_others_can_read_and_one_with_no_active_key() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keys");
    std::fs::write(&path, file::render(&[key(100, 1)])).unwrap();
    for (mode, ok) in [
        (0o600, true),
        (0o640, true),
        (0o400, true),
        (0o644, false),
        (0o660, false),
        (0o602, false),
    ] {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        let read = file::read(&path, 200);
        assert_eq!(read.is_ok(), ok, "mode {mode:o}: {read:?}");
    }
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let err = file::read(&path, 99).unwrap_err().to_string();
    assert!(err.contains("no key is active yet"), "{err}");
}

#[test]
fn rotate_adds_a_waiting_key_and_drops_retired_ones() {
    const LIFE: u64 = 100;
    let keys = vec![key(0, 1)];
    let keys = file::rotate(keys, 1000, 60, LIFE).unwrap();
    assert_eq!(keys.iter().map(|k| k.not_before).collect::<Vec<_>>(), [1060, 0]);
    // Rotating again before the first new key is active: it goes after it.
    let keys = file::rotate(keys, 1010, 0, LIFE).unwrap();
    assert_eq!(
        keys.iter().map(|k| k.not_before).collect::<Vec<_>>(),
        [1061, 1060, 0]
    );
    // Once 1060's successor (1061) has encrypted for longer than a ticket lives, 1060
    // and 0 go; 1061 stays as the encrypting one, beside the new waiting key.
    let keys = file::rotate(keys, 1061 + LIFE, 30, LIFE).unwrap();
    assert_eq!(
        keys.iter().map(|k| k.not_before).collect::<Vec<_>>(),
        [1061 + LIFE + 30, 1061]
    );
}

#[test]
fn rotate_file_keeps_the_mode_and_the_old_keys_readable() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keys");
    std::fs::write(&path, new_file().unwrap()).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
    let before = file::read(&path, unix_now()).unwrap();
    let (newest, count) = rotate_file(&path, 3600).unwrap();
    assert_eq!(count, 2);
    assert!(newest >= unix_now() + 3590);
    let after = file::read(&path, unix_now()).unwrap();
    assert!(after.contains(&before[0]));
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o640);
    // The old key still encrypts until the new one's time comes.
    let t = Tickets::new(Some(&path)).unwrap();
    let ticket = t.seal(b"a", unix_now()).unwrap();
    assert!(from_keys(&before).open(&ticket).is_some());
}

#[test]
fn rotate_file_is_not_blocked_by_a_crashed_runs_leftover() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keys");
    std::fs::write(&path, new_file().unwrap()).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    // What an interrupted rotation used to leave beside the file.
    std::fs::write(dir.path().join("keys.new"), b"half a file").unwrap();
    let rotated = rotate_file(&path, 3600);
    assert!(
        rotated.is_ok(),
        "a leftover temporary file blocked the rotation: {rotated:?}"
    );
    assert_eq!(file::read(&path, unix_now()).unwrap().len(), 2);
}

#[test]
fn a_key_file_owned_by_another_user_is_refused() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keys");
    create_file(&path).unwrap();
    let f = std::fs::File::open(&path).unwrap();
    let uid = f.metadata().unwrap().uid();
    file::check_owner(&path, &f, &[0, uid]).unwrap();
    let err = file::check_owner(&path, &f, &[uid.wrapping_add(1)])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("owned by uid {uid}")) && err.contains("fix: `chown root FILE`"),
        "{err}"
    );
    // What this process writes it owns, so it reads it back.
    assert_eq!(file::read(&path, unix_now()).unwrap().len(), 1);
}

#[test]
fn create_file_writes_0600_and_never_overwrites() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keys");
    create_file(&path).unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o600);
    let before = std::fs::read(&path).unwrap();
    let err = create_file(&path).unwrap_err();
    assert!(matches!(err, TicketKeyError::Exists { .. }), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), before);
}

#[test]
fn rotate_file_through_a_symlink_replaces_its_target_and_keeps_the_link() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let real = dir.path().join("real.keys");
    create_file(&real).unwrap();
    let link = dir.path().join("ticket.keys");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    rotate_file(&link, 3600).unwrap();
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    assert_eq!(file::read(&real, unix_now()).unwrap().len(), 2);
    let mode = std::fs::metadata(&real).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o600);
}

#[test]
fn debug_output_names_no_key_material() {
    let k = key(5, 0xab);
    let text = format!("{k:?} {:?}", from_keys(std::slice::from_ref(&k)));
    assert!(
        !text.contains("ab, ab") && !text.contains("abab") && !text.contains("171"),
        "{text}"
    );
}

#[test]
fn every_tcp_site_and_the_quic_endpoint_seal_with_the_shared_keys() {
    let config = crate::config::builtin_default(Path::new("/")).unwrap();
    assert!(config.sites.iter().any(|s| s.protocols.h3));
    let shared = crate::tls::Shared::new(None).unwrap();
    let sites = crate::tls::SiteNames::new(&config);
    let acceptor = crate::tls::Acceptor::build(&config, &sites, &shared).unwrap();
    let quic = acceptor.quic_config().expect("the built-in site serves h3");
    let ours = Arc::as_ptr(&shared.ticketer);
    assert!(std::ptr::addr_eq(Arc::as_ptr(&quic.ticketer), ours));
    for tcp in &acceptor.configs {
        assert!(std::ptr::addr_eq(Arc::as_ptr(&tcp.ticketer), ours));
        assert_eq!(tcp.max_early_data_size, 0);
    }
    // No early data over QUIC: a replayable 0-RTT request is never accepted.
    assert_eq!(quic.max_early_data_size, 0);
    // A ticket the QUIC config seals opens through the shared key set.
    let ticket = quic.ticketer.encrypt(b"state").unwrap();
    assert_eq!(shared.tickets.open(&ticket).unwrap(), b"state");
}
