//! Reading versioned JSON files: the format string and version are checked before the fields.

use crate::error::{CoreError, Result};
use serde::de::DeserializeOwned;

/// Parse `text` as a `kind` file (e.g. "profile") of format `format`, version 1 to `version`.
/// `remedy` says how to get a readable file (e.g. "re-profile the model").
pub fn read_versioned<T: DeserializeOwned>(text: &str, kind: &str, format: &str, version: u32, remedy: &str) -> Result<T> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| CoreError::Format(format!("{kind} is not JSON: {e}")))?;
    let found = value.get("format").and_then(|v| v.as_str()).unwrap_or("");
    if found != format {
        return Err(CoreError::Format(format!(
            "expected \"format\": \"{format}\", found {found:?}; is this a tensorplace {kind}?"
        )));
    }
    let v = value.get("version").and_then(|v| v.as_u64()).unwrap_or(0);
    if v == 0 || v > version as u64 {
        let reads = if version == 1 { "version 1".to_string() } else { format!("versions 1 to {version}") };
        return Err(CoreError::Format(format!("{kind} version {v} is not supported (this tensorplace reads {reads}); {remedy}")));
    }
    serde_json::from_value(value).map_err(|e| CoreError::Format(format!("{kind} does not match format version {v}: {e}")))
}
