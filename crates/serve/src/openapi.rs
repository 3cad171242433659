//! The API as a document: the OpenAPI 3.1 description served at `GET /openapi.json`, and
//! the manager's own routes, which the unit tests hold to it (with the VMM's routes, served
//! under `/sandboxes/{name}`), so that neither can change without the other.

/// The API described: an OpenAPI 3.1 document, served at `GET /openapi.json`. The unit tests
/// check that its operations are [`ROUTES`] and the VMM's routes under
/// `/sandboxes/{name}/vm`; `tests/tests/host_serve.rs` sends each to a running manager, and
/// `tests/tests/host_openapi.rs` has schemathesis check a running manager against all of it
/// (statuses, bodies, headers, what it must accept and what it must refuse).
pub const OPENAPI: &str = include_str!("openapi.json");

/// The manager's own routes, as (method, path with `{name}` for a sandbox's name); every
/// VMM route is served under `/sandboxes/{name}` too (see `routes.rs`).
pub const ROUTES: &[(&str, &str)] = &[
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
    ("GET", "/sandboxes"),
    ("POST", "/sandboxes"),
    ("GET", "/sandboxes/{name}"),
    ("DELETE", "/sandboxes/{name}"),
    ("PUT", "/sandboxes/{name}/pause"),
    ("PUT", "/sandboxes/{name}/resume"),
    ("PUT", "/sandboxes/{name}/token"),
    ("DELETE", "/sandboxes/{name}/token"),
    ("POST", "/sandboxes/{name}/credential"),
    ("DELETE", "/sandboxes/{name}/credential"),
    ("POST", "/sandboxes/{name}/fork"),
    ("GET", "/sandboxes/{name}/ports"),
    ("POST", "/sandboxes/{name}/ports"),
    ("DELETE", "/sandboxes/{name}/ports/{guest_port}"),
    ("POST", "/credentials/verify"),
];

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use serde_json::Value;

    use super::{OPENAPI, ROUTES};

    fn documented() -> (Value, BTreeSet<(String, String)>) {
        let doc: Value = serde_json::from_str(OPENAPI).expect("openapi.json is JSON");
        let mut ops = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for method in item.as_object().expect("a path item").keys() {
                if method != "parameters" {
                    ops.insert((method.to_uppercase(), path.clone()));
                }
            }
        }
        (doc, ops)
    }

    #[test]
    fn the_openapi_document_lists_exactly_the_routes_served() {
        let (_, documented) = documented();
        let served: BTreeSet<(String, String)> = ROUTES
            .iter()
            .map(|(m, p)| (m.to_string(), p.to_string()))
            .chain(
                mayfly_api::routes()
                    .map(|(m, p)| (m.to_string(), format!("/sandboxes/{{name}}{p}"))),
            )
            .collect();
        let undocumented: Vec<_> = served.difference(&documented).collect();
        let not_served: Vec<_> = documented.difference(&served).collect();
        assert!(
            undocumented.is_empty() && not_served.is_empty(),
            "served but not in openapi.json: {undocumented:?}; documented but not served: \
             {not_served:?}"
        );
    }

    #[test]
    fn every_documented_operation_has_an_id_answers_and_resolvable_schemas() {
        let (doc, _) = documented();
        let mut ids = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                if method == "parameters" {
                    continue;
                }
                let id = op["operationId"].as_str().unwrap_or_default();
                assert!(!id.is_empty(), "{method} {path} has no operationId");
                assert!(ids.insert(id.to_string()), "operationId {id} twice");
                let responses = op["responses"].as_object().unwrap();
                // A route kept only to refuse (a sandbox's `PUT /vm/fork` and `/vm/shutdown`)
                // says so; every other one documents its success.
                let refused = op["x-mayfly-refused"] == true;
                assert_eq!(
                    responses.keys().any(|c| c.starts_with('2')),
                    !refused,
                    "{method} {path}: a success documented, or x-mayfly-refused, not both"
                );
            }
        }
        // Every $ref names a schema, a response or a parameter that is there.
        fn refs(v: &Value, out: &mut Vec<String>) {
            match v {
                Value::Object(o) => {
                    if let Some(Value::String(r)) = o.get("$ref") {
                        out.push(r.clone());
                    }
                    o.values().for_each(|v| refs(v, out));
                }
                Value::Array(a) => a.iter().for_each(|v| refs(v, out)),
                _ => {}
            }
        }
        let mut all = Vec::new();
        refs(&doc, &mut all);
        for r in all {
            let (kind, name) = r
                .strip_prefix("#/components/")
                .and_then(|rest| rest.split_once('/'))
                .unwrap_or_else(|| panic!("{r}: only refs to the document's own components"));
            assert!(
                ["schemas", "responses", "parameters"].contains(&kind),
                "{r}: a schema, a response or a parameter"
            );
            assert!(
                doc["components"][kind][name].is_object(),
                "{r} is not defined"
            );
        }
    }
}
