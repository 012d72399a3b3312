//! # names — enums the API takes by name
//!
//! serde's derived `Deserialize` for a unit-variant enum answers a value of the wrong JSON
//! type (`"restart": true`) with "expected value" or "expected string or map", naming
//! nothing a caller can use. The enums the API takes by name deserialize through
//! [`by_name`] instead: any value that is not one of the names — a wrong string or another
//! JSON type — is refused listing the allowed names.

use serde::de::{Deserializer, Error, Unexpected, Visitor};

/// Deserializes one of `names` (`(wire name, value)`), refusing anything else with an error
/// that lists every name.
pub fn by_name<'de, D, T>(d: D, names: &'static [(&'static str, T)]) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Copy + 'static,
{
    struct Names<T: 'static>(&'static [(&'static str, T)]);
    impl<T: Copy + 'static> Visitor<'_> for Names<T> {
        type Value = T;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            let list: Vec<String> = self.0.iter().map(|(n, _)| format!("\"{n}\"")).collect();
            write!(f, "one of {}", list.join(", "))
        }
        fn visit_str<E: Error>(self, v: &str) -> Result<T, E> {
            self.0
                .iter()
                .find(|(n, _)| *n == v)
                .map(|(_, t)| *t)
                .ok_or_else(|| E::invalid_value(Unexpected::Str(v), &self))
        }
    }
    d.deserialize_str(Names(names))
}

/// Implements `Deserialize` for a name-valued enum through [`by_name`].
#[macro_export]
macro_rules! deserialize_by_name {
    ($t:ty, [$(($name:literal, $v:expr)),+ $(,)?]) => {
        impl<'de> serde::Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> ::std::result::Result<Self, D::Error> {
                $crate::names::by_name(d, &[$(($name, $v)),+])
            }
        }
    };
}

#[cfg(test)]
mod tests {
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Color {
        Red,
        Dark,
    }
    crate::deserialize_by_name!(Color, [("red", Color::Red), ("dark-blue", Color::Dark)]);

    #[test]
    fn a_name_is_read_and_anything_else_lists_the_names() {
        assert_eq!(serde_json::from_str::<Color>("\"dark-blue\"").unwrap(), Color::Dark);
        for bad in ["true", "1", "null", "\"green\"", "{}", "[\"red\"]"] {
            let e = serde_json::from_str::<Color>(bad).unwrap_err().to_string();
            assert!(e.contains("one of \"red\", \"dark-blue\""), "{bad}: {e}");
        }
        let e = serde_json::from_value::<Color>(serde_json::json!(false)).unwrap_err().to_string();
        assert!(e.contains("one of \"red\", \"dark-blue\""), "{e}");
    }
}
