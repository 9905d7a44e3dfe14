//! JSON written the same way in every build: objects with their keys
//! sorted.
//!
//! `serde_json` keeps an object's keys sorted unless its `preserve_order`
//! feature is on, and then keeps them in insertion order. Cargo turns a
//! feature on for every crate of a build when any one crate asks for it (a
//! grammar engine of the server does), so a file written from a
//! `serde_json::Value` would change bytes with what else is compiled
//! beside it. Writers of files whose bytes matter (configs, headers,
//! indexes; digests are taken of them) go through [`sorted`].

use serde_json::{Map, Value};

/// `value` with every object's keys in sorted order, whatever
/// `serde_json`'s features are.
pub fn sorted(value: &Value) -> Value {
    match value {
        Value::Object(object) => {
            let mut keys: Vec<&String> = object.keys().collect();
            keys.sort();
            let mut out = Map::new();
            for key in keys {
                out.insert(key.clone(), sorted(&object[key]));
            }
            Value::Object(out)
        }
        Value::Array(items) => Value::Array(items.iter().map(sorted).collect()),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_come_out_sorted_at_every_depth() {
        let value = serde_json::json!({"b": 1, "a": {"d": [{"z": 0, "y": 1}], "c": 2}});
        assert_eq!(
            serde_json::to_string(&sorted(&value)).unwrap(),
            r#"{"a":{"c":2,"d":[{"y":1,"z":0}]},"b":1}"#
        );
    }
}
