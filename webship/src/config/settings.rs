//! The `[runtime.settings]` keys, each described once: its name, the field it sets,
//! its default and the range it accepts. The settings structs' `Default`, the
//! known-key list, parsing and range checks all come from the one table below, so a
//! new key is one line in it. Its field in `model.rs` follows (the generated `Default`
//! does not compile without it, nor with a field the table lacks), and so does its
//! line in the README's example (a unit test compares the two).
//!
//! Values are strings holding whole numbers (the spec writes
//! `h2_tls_write_buffer_bytes = "131072"`); a flag is "0" or "1". A key may also
//! accept one word (`h3_mtu_upper_bound_bytes = "auto"`), stored as a number outside
//! its range so the table stays one of numbers.

use std::ops::RangeInclusive;

use super::{H2Settings, H3Settings, MtuBound, ProxyH2Settings};

/// One `[runtime.settings]` key.
pub(super) struct Setting {
    pub(super) name: &'static str,
    /// Every accepted value fits the field's type; `every_range_fits_its_field`
    /// checks both ends.
    pub(super) range: RangeInclusive<u64>,
    /// A word the key accepts besides numbers, and the number (outside `range`) it
    /// stands for in the field.
    pub(super) word: Option<(&'static str, u64)>,
    set: fn(&mut Tuned, u64),
    get: fn(&Tuned) -> u64,
}

impl Setting {
    /// The key's value as a number in its range, or `None`.
    pub(super) fn parse(&self, value: &str) -> Option<u64> {
        let value = value.trim();
        if let Some((_, n)) = self.word.filter(|(word, _)| *word == value) {
            return Some(n);
        }
        value.parse::<u64>().ok().filter(|n| self.range.contains(n))
    }

    /// Stores an in-range value in its field.
    pub(super) fn set(&self, tuned: &mut Tuned, n: u64) {
        (self.set)(tuned, n);
    }

    /// The value the key has when the file does not set it.
    pub(super) fn default_value(&self) -> u64 {
        (self.get)(&Tuned::default())
    }

    /// The default as the file would write it: the word when it stands for it.
    #[cfg(test)]
    pub(super) fn default_text(&self) -> String {
        let n = self.default_value();
        match self.word {
            Some((word, w)) if w == n => word.to_owned(),
            _ => n.to_string(),
        }
    }

    /// What the key accepts, for error messages.
    pub(super) fn accepted(&self) -> String {
        let numbers = format!(
            "a whole number from {} to {}",
            self.range.start(),
            self.range.end()
        );
        match self.word {
            Some((word, _)) => format!("\"{word}\" or {numbers}"),
            None => numbers,
        }
    }

    /// How to write a value the key accepts, for error messages.
    pub(super) fn fix(&self) -> String {
        match self.word {
            Some((word, _)) => format!(
                "write \"{word}\" or a quoted number, e.g. \"{}\"",
                self.range.start()
            ),
            None => format!("write it as a quoted number, e.g. \"{}\"", self.default_value()),
        }
    }

    #[cfg(test)]
    pub(super) fn get(&self, tuned: &Tuned) -> u64 {
        (self.get)(tuned)
    }
}

/// The key named `name`, if this build knows it.
pub(super) fn find(name: &str) -> Option<&'static Setting> {
    SETTINGS.iter().find(|s| s.name == name)
}

/// The names of every key, in table order (the order error messages list them in).
pub(super) fn names() -> impl Iterator<Item = &'static str> {
    SETTINGS.iter().map(|s| s.name)
}

/// A field type a setting can hold. The ranges keep values inside the type, so the
/// saturating conversion never saturates.
trait Value: Copy {
    fn from_setting(n: u64) -> Self;
    fn to_setting(self) -> u64;
}

macro_rules! int_value {
    ($($t:ty),*) => {$(
        impl Value for $t {
            fn from_setting(n: u64) -> Self {
                Self::try_from(n).unwrap_or(Self::MAX)
            }
            fn to_setting(self) -> u64 {
                u64::try_from(self).unwrap_or(u64::MAX)
            }
        }
    )*};
}

int_value!(u16, u32, u64, usize);

/// 0 is `auto` (the key's word; below its range).
impl Value for MtuBound {
    fn from_setting(n: u64) -> Self {
        match n {
            0 => MtuBound::Auto,
            n => MtuBound::Fixed(Value::from_setting(n)),
        }
    }
    fn to_setting(self) -> u64 {
        match self {
            MtuBound::Auto => 0,
            MtuBound::Fixed(n) => n.to_setting(),
        }
    }
}

impl Value for bool {
    fn from_setting(n: u64) -> Self {
        n == 1
    }
    fn to_setting(self) -> u64 {
        u64::from(self)
    }
}

/// Writes the table: `Default` for each settings struct (every field must appear, or
/// the struct literal does not compile), the `Tuned` bundle a table fills, and
/// `SETTINGS`, in the order given.
macro_rules! runtime_settings {
    ($(
        $group:ident: $ty:ident {
            $($name:literal => $field:ident = $default:expr, $range:expr $(, or $word:literal = $code:expr)?;)*
        }
    )*) => {
        $(impl Default for $ty {
            fn default() -> Self {
                Self { $($field: $default,)* }
            }
        })*

        /// Every settings struct `[runtime.settings]` fills, starting from defaults.
        #[derive(Debug, Default)]
        pub(super) struct Tuned {
            $(pub(super) $group: $ty,)*
        }

        const SETTINGS: &[Setting] = &[$($(Setting {
            name: $name,
            range: $range,
            word: word!($($word, $code)?),
            set: |t, n| t.$group.$field = Value::from_setting(n),
            get: |t| t.$group.$field.to_setting(),
        },)*)*];
    };
}

/// A setting's optional word, as [`Setting::word`] holds it.
macro_rules! word {
    () => {
        None
    };
    ($word:literal, $code:expr) => {
        Some(($word, $code))
    };
}

// "key" => field = default, accepted range[, or "word" = the number it stores];
runtime_settings! {
    h2: H2Settings {
        "h2_tls_write_buffer_bytes" => tls_write_buffer_bytes = 128 * 1024, 16 * 1024..=16 * 1024 * 1024;
        "h2_initial_stream_window_bytes" => initial_stream_window_bytes = 1024 * 1024, 65_535..=(1 << 31) - 1;
        "h2_initial_connection_window_bytes" =>
            initial_connection_window_bytes = 16 * 1024 * 1024, 65_535..=(1 << 31) - 1;
        "h2_max_frame_size_bytes" => max_frame_size_bytes = 64 * 1024, 16_384..=(1 << 24) - 1;
        "h2_max_concurrent_streams" => max_concurrent_streams = 256, 1..=10_000;
        "h2_max_send_buffer_bytes" => max_send_buffer_bytes = 256 * 1024, 16 * 1024..=64 * 1024 * 1024;
    }
    h3: H3Settings {
        "h3_send_window_bytes" => send_window_bytes = 16 * 1024 * 1024, 64 * 1024..=1024 * 1024 * 1024;
        "h3_stream_receive_window_bytes" => stream_receive_window_bytes = 1024 * 1024, 16 * 1024..=1 << 30;
        "h3_receive_window_bytes" => receive_window_bytes = 8 * 1024 * 1024, 16 * 1024..=1 << 30;
        "h3_max_concurrent_streams" => max_concurrent_streams = 256, 1..=10_000;
        "h3_mtu_upper_bound_bytes" =>
            mtu_upper_bound_bytes = MtuBound::Auto, 1200..=65_527, or "auto" = 0;
        "h3_gso" => gso = true, 0..=1;
        "h3_bbr_switch_bytes" => bbr_switch_bytes = 1024 * 1024, 0..=1 << 40;
        "h3_initial_window_packets" => initial_window_packets = 32, 10..=200;
        "h3_retry" => always_retry = false, 0..=1;
        "h3_sockets" => sockets = 1, 0..=32;
        "h3_send_batch_delay_us" => send_batch_delay_us = 0, 0..=1000;
    }
    proxy_h2: ProxyH2Settings {
        "proxy_h2_tls_max_send_buffer_bytes" =>
            tls_max_send_buffer_bytes = 128 * 1024, 16 * 1024..=64 * 1024 * 1024;
        "proxy_h2_tls_connection_send_buffer_bytes" =>
            tls_connection_send_buffer_bytes = 128 * 1024 * 256, 16 * 1024..=4 * 1024 * 1024 * 1024;
    }
}
