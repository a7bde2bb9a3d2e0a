//! The PROXY protocol header parser (the first bytes a load balancer sends) on
//! arbitrary bytes: never a panic, a complete header never longer than the input and
//! not changed by what follows it, an incomplete one bounded, and whatever the
//! encoder writes read back as the same addresses.

#![no_main]

use libfuzzer_sys::fuzz_target;
use webship::proxy_protocol::{encode, parse, Carried, Parsed, ProxyProtocol, V2_MAX_PAYLOAD};

fuzz_target!(|data: &[u8]| {
    match parse(data) {
        Ok(Parsed::Complete { header, len }) => {
            assert!(len <= data.len());
            assert_eq!(parse(&data[..len]), Ok(Parsed::Complete { header, len }));
            let mut longer = data.to_vec();
            longer.extend_from_slice(&[0x16, 0x03, 0x01]);
            assert_eq!(parse(&longer), Ok(Parsed::Complete { header, len }));
            if let Carried::Proxied { client, destination } = header {
                for version in [ProxyProtocol::V1, ProxyProtocol::V2] {
                    let bytes = encode(version, client, destination);
                    let Ok(Parsed::Complete {
                        header:
                            Carried::Proxied {
                                client: c,
                                destination: d,
                            },
                        len,
                    }) = parse(&bytes)
                    else {
                        panic!("{version}: {bytes:?} does not read back");
                    };
                    assert_eq!(len, bytes.len());
                    assert_eq!(
                        (c.ip().to_canonical(), c.port()),
                        (client.ip().to_canonical(), client.port())
                    );
                    assert_eq!(
                        (d.ip().to_canonical(), d.port()),
                        (destination.ip().to_canonical(), destination.port())
                    );
                }
            }
        }
        Ok(Parsed::Incomplete { up_to }) => assert!(up_to > data.len() && up_to <= 16 + V2_MAX_PAYLOAD),
        Err(_) => {}
    }
});
