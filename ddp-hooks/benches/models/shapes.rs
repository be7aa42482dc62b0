//! The user's model for `cargo xtask bench --shapes FILE`: a JSON list of parameter
//! shapes, as PyTorch prints them with
//!
//! ```python
//! import json, torch; model = ...
//! print(json.dumps([list(p.shape) for p in model.parameters()]))
//! ```
//!
//! (`[[768, 768], [768], ...]`, forward order), or an object `{"name": "my model",
//! "shapes": [...]}`. Shared by the report bench and `xtask` (which checks the file before
//! it builds anything), both through `#[path]`.

#![allow(dead_code)]

use serde_json::Value;

/// The most gradient elements a model may have: the report holds about ten `f32` copies
/// of the gradient at once (two ranks' gradients, the buckets of the three alternated
/// hooks on each rank, PowerSGD's memories), so 200 M elements (800 MB a copy) need about
/// 8 GB of memory. GPT-2 small has 124 M.
pub const MAX_ELEMENTS: usize = 200_000_000;

/// The most characters of a model name (the table's first column).
pub const MAX_NAME: usize = 40;

/// A model read from a shapes file.
#[derive(Clone, Debug, PartialEq)]
pub struct UserModel {
    /// `name` of the object, or the file's name without its extension.
    pub name: String,
    /// Parameter shapes in forward order; a scalar parameter (`[]`) is `[1]`.
    pub shapes: Vec<Vec<usize>>,
}

/// Reads and checks `path` (see the module docs); the error says what is wrong and where.
pub fn read(path: &std::path::Path) -> Result<UserModel, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--shapes {}: cannot read it: {e}", path.display()))?;
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    parse(&text, &stem).map_err(|e| format!("--shapes {}: {e}", path.display()))
}

/// Parses a shapes file's text; `default_name` names a bare list.
pub fn parse(text: &str, default_name: &str) -> Result<UserModel, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| {
        format!("not JSON ({e}); expected a list of shapes such as [[768, 768], [768]] or {{\"name\": ..., \"shapes\": [...]}}")
    })?;
    let (name, list) = match &v {
        Value::Array(list) => (default_name.to_string(), list),
        Value::Object(o) => {
            if let Some(k) = o.keys().find(|k| !matches!(k.as_str(), "name" | "shapes")) {
                return Err(format!(
                    "unknown key `{k}` (an object takes `name` and `shapes`)"
                ));
            }
            let name = match o.get("name") {
                None => default_name.to_string(),
                Some(Value::String(s)) => s.clone(),
                Some(other) => return Err(format!("`name` must be a string, got {other}")),
            };
            match o.get("shapes") {
                Some(Value::Array(list)) => (name, list),
                Some(other) => {
                    return Err(format!(
                        "`shapes` must be a list of shapes, got {}",
                        excerpt(other)
                    ))
                }
                None => return Err("the object has no `shapes`".into()),
            }
        }
        other => {
            return Err(format!(
                "expected a list of shapes or an object with `shapes`, got {}",
                excerpt(other)
            ))
        }
    };
    let name = name.trim().to_string();
    if name.is_empty() || name.chars().count() > MAX_NAME || name.chars().any(char::is_control) {
        return Err(format!(
            "the model name {name:?} must have 1 to {MAX_NAME} characters and no control characters"
        ));
    }
    if list.is_empty() {
        return Err("the list of shapes is empty: the model has no parameters".into());
    }
    let mut shapes = Vec::with_capacity(list.len());
    let mut total: usize = 0;
    for (i, s) in list.iter().enumerate() {
        let dims = s.as_array().ok_or_else(|| {
            format!(
                "parameter {i}: a shape is a list of dimensions, got {}",
                excerpt(s)
            )
        })?;
        let mut shape = Vec::with_capacity(dims.len().max(1));
        for d in dims {
            match d.as_u64().filter(|&d| d > 0) {
                Some(d) => shape.push(usize::try_from(d).unwrap_or(usize::MAX)),
                None => {
                    return Err(format!(
                        "parameter {i}: dimension {d} of shape {s} is not a positive integer"
                    ))
                }
            }
        }
        if shape.is_empty() {
            shape.push(1);
        }
        let n = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .filter(|&n| n <= MAX_ELEMENTS);
        total = n
            .and_then(|n| total.checked_add(n))
            .filter(|&t| t <= MAX_ELEMENTS)
            .ok_or_else(|| {
                format!(
                    "parameter {i} (shape {s}) takes the model past {MAX_ELEMENTS} gradient elements, the most the report measures (it holds about ten f32 copies of the gradient, about 8 GB at the limit)"
                )
            })?;
        shapes.push(shape);
    }
    Ok(UserModel { name, shapes })
}

/// A JSON value, cut to 60 characters for an error message.
fn excerpt(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 60 {
        format!("{}...", s.chars().take(60).collect::<String>())
    } else {
        s
    }
}
