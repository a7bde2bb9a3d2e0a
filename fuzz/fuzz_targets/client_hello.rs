//! The passthrough SNI parser on arbitrary bytes: it must never panic, and what it
//! reports must not depend on bytes after a complete hello.

#![no_main]

use libfuzzer_sys::fuzz_target;
use webship::passthrough::client_hello::{parse, Hello};

fuzz_target!(|data: &[u8]| {
    let whole = parse(data);
    if let Ok(Hello::Complete { sni }) = &whole {
        if let Some(name) = sni {
            // Names come out lowercased, never empty, never with a NUL.
            assert!(!name.is_empty());
            assert!(!name.bytes().any(|b| b == 0 || b.is_ascii_uppercase()));
        }
        // Appending bytes never changes a complete verdict.
        let mut longer = data.to_vec();
        longer.extend_from_slice(&[0x16, 0x03, 0x01, 0x00, 0x00]);
        assert_eq!(parse(&longer), whole);
    }
    // A prefix of a complete hello is at most incomplete, never a different name.
    if data.len() > 1 {
        match parse(&data[..data.len() / 2]) {
            Ok(Hello::Complete { sni }) => assert_eq!(Ok(Hello::Complete { sni }), whole),
            Ok(Hello::Incomplete) | Err(_) => {}
        }
    }
});
