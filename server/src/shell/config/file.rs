//! The TOML file: every component's options as top-level keys, read into `Settings`.

use std::path::Path;

use serde::de::{self, Deserialize, Deserializer, Visitor};

use super::{ConfigError, Settings};

/// Reads `path`; a refusal is one line that says why.
pub(super) fn read(path: &Path) -> Result<Settings, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::ReadFile {
        path: path.to_owned(),
        source,
    })?;
    toml::from_str(&text).map_err(|e| ConfigError::ParseFile {
        path: path.to_owned(),
        // toml's message spans several lines (with a source excerpt); keep the first.
        message: with_the_keys(e.message().lines().next().unwrap_or("invalid TOML")),
    })
}

/// serde refuses an unknown key of a struct made of flattened parts without the list of known
/// ones: give it, as serde does for a plain struct.
fn with_the_keys(message: &str) -> String {
    // A nested table (`[[teams]]`) is a plain struct: serde lists its keys itself.
    if !message.starts_with("unknown field `") || message.contains(", expected") {
        return message.to_owned();
    }
    let keys: Vec<String> = keys().iter().map(|k| format!("`{k}`")).collect();
    format!("{message}, expected one of {}", keys.join(", "))
}

/// Every key the file takes, component by component, in the order of [`Settings`].
fn keys() -> Vec<&'static str> {
    [
        keys_of::<crate::shell::serve::ServeOptions>(),
        keys_of::<crate::plumbing::proxy::ForwarderOptions>(),
        keys_of::<crate::plumbing::client::ClientOptions>(),
        keys_of::<crate::capabilities::fairshare::FairShareOptions>(),
        keys_of::<crate::plumbing::store::StoreOptions>(),
        keys_of::<crate::plumbing::telemetry::LogOptions>(),
        keys_of::<crate::capabilities::rewrite::ScopeOptions>(),
        keys_of::<crate::capabilities::dedup::DedupOptions>(),
        keys_of::<crate::capabilities::coalesce::CoalesceOptions>(),
        keys_of::<crate::capabilities::artifacts::ArtifactsOptions>(),
        keys_of::<crate::capabilities::health::HealthOptions>(),
    ]
    .concat()
}

/// The field names a derived `Deserialize` struct asks for (its skipped fields left out): the
/// names it passes to `deserialize_struct`, read by a deserializer that reads nothing else.
fn keys_of<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
    struct Names(&'static [&'static str]);
    impl<'de> Deserializer<'de> for &mut Names {
        type Error = de::value::Error;

        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _name: &'static str,
            fields: &'static [&'static str],
            _visitor: V,
        ) -> Result<V::Value, Self::Error> {
            self.0 = fields;
            Err(de::Error::custom("only the field names were wanted"))
        }

        fn deserialize_any<V: Visitor<'de>>(self, _visitor: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("not a struct"))
        }

        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    let mut names = Names(&[]);
    let _ = T::deserialize(&mut names);
    names.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_component_names_its_keys() {
        let keys = keys();
        for key in [
            "listen",
            "upstream",
            "teams",
            "dedup",
            "artifact_part_size",
            "run_health",
        ] {
            assert!(keys.contains(&key), "{key} missing from {keys:?}");
        }
        assert!(
            !keys.contains(&"mlflow_service_token"),
            "credentials are never read from the file"
        );
    }

    /// The list of keys must not miss a component: every flag is a key the list names, or one the
    /// file refuses (a credential).
    #[test]
    fn the_keys_listed_are_the_keys_the_file_takes() {
        use clap::Args as _;
        let keys = keys();
        let command = Settings::augment_args(clap::Command::new("keys"));
        for arg in command.get_arguments() {
            let id = arg.get_id().as_str();
            let refused = toml::from_str::<Settings>(&format!("{id} = 0"))
                .err()
                .is_some_and(|e| e.message().starts_with(&format!("unknown field `{id}`")));
            assert!(
                keys.contains(&id) != refused,
                "{id}: listed {}, refused {refused}",
                keys.contains(&id)
            );
        }
        for key in &keys {
            let refused = toml::from_str::<Settings>(&format!("{key} = 0"))
                .err()
                .is_some_and(|e| e.message().starts_with("unknown field"));
            assert!(!refused, "{key} is listed but refused");
        }
    }
}
