//! TLS passthrough: routing a connection by the SNI of its ClientHello without ever
//! decrypting it. This module holds the parser today; the splicing engines arrive
//! with the passthrough mode.

pub mod client_hello;
