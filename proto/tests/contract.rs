//! Proves that `proto/csi.proto` is the CSI v1.14.0 wire contract: the official
//! `csi.proto` is fetched as a Go module, both files are compiled with protox, and
//! every part of the contract is compared (names, numbers, types, labels, oneofs,
//! streaming, options including the CSI extension options). Comments, spans and the
//! order of declarations are not part of the contract and are ignored.
//!
//! The second test feeds the checker mutated copies of the official file, so a
//! checker that silently compares nothing cannot pass.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

const SPEC_MODULE: &str = "github.com/container-storage-interface/spec";
const SPEC_VERSION: &str = "v1.14.0";
/// The Go checksum of the module zip; pinned so that a different file can never be
/// taken for v1.14.0.
const SPEC_SUM: &str = "h1:lVswmW9+n0J6FrdO4eVg28s8CEyfo//BEuwclY6FBsQ=";
const GO_FALLBACK: &str = "/usr/local/go/bin/go";

/// The comparison: each file becomes a tree of named items with attributes, and two
/// trees are diffed by name.
mod contract {
    use std::collections::BTreeMap;
    use std::fmt::Display;
    use std::path::Path;

    use prost_reflect::{DescriptorPool, DynamicMessage};
    use prost_types::field_descriptor_proto::{Label, Type};
    use prost_types::{
        DescriptorProto, EnumDescriptorProto, EnumValueDescriptorProto, FieldDescriptorProto,
        FileDescriptorProto, MethodDescriptorProto, OneofDescriptorProto, ServiceDescriptorProto,
    };
    use protox::file::{ChainFileResolver, File, FileResolver, GoogleFileResolver};
    use protox::Compiler;

    /// One declaration: its attributes (`number`, `type`, `option (csi.v1.csi_secret)`,
    /// ...) and the declarations inside it, keyed by kind and name (`field secrets`).
    #[derive(Debug, Default, PartialEq)]
    pub struct Node {
        pub attrs: BTreeMap<String, String>,
        pub children: BTreeMap<String, Node>,
    }

    impl Node {
        fn attr(&mut self, key: impl Into<String>, value: impl Display) {
            self.attrs.insert(key.into(), value.to_string());
        }

        fn child(&mut self, key: String, node: Node) {
            let previous = self.children.insert(key.clone(), node);
            assert!(previous.is_none(), "two declarations named {key}");
        }

        /// The node at a path of child keys, for assertions about the tree itself.
        pub fn at(&self, path: &[&str]) -> Option<&Node> {
            path.iter()
                .try_fold(self, |node, key| node.children.get(*key))
        }

        pub fn count(&self) -> usize {
            1 + self.children.values().map(Node::count).sum::<usize>()
        }

        /// Decoded options: known fields by name, extensions by full name in
        /// parentheses, and anything undecodable by number, so that no option can
        /// go unseen.
        fn options(&mut self, options: &DynamicMessage) {
            for (field, value) in options.fields() {
                self.attr(format!("option {}", field.name()), value);
            }
            for (extension, value) in options.extensions() {
                self.attr(format!("option ({})", extension.full_name()), value);
            }
            for unknown in options.unknown_fields() {
                let key = format!("option #{}", unknown.number());
                let entry = self.attrs.entry(key).or_default();
                entry.push_str(&format!("{unknown};"));
            }
        }
    }

    /// Compiles `dir/file` with `dir` as its only include path (plus protox's
    /// built-in google/protobuf files) and describes it.
    pub fn from_dir(dir: &Path, file: &str) -> Result<Node, String> {
        let mut compiler = Compiler::new([dir]).map_err(|e| format!("{e:?}"))?;
        compiler
            .open_file(dir.join(file))
            .map_err(|e| format!("cannot compile {}: {e:?}", dir.join(file).display()))?;
        Ok(describe(&compiler.descriptor_pool(), file))
    }

    /// Compiles proto source held in memory as `file` and describes it.
    pub fn from_source(file: &str, source: &str) -> Result<Node, String> {
        struct Memory(String, String);
        impl FileResolver for Memory {
            fn open_file(&self, name: &str) -> Result<File, protox::Error> {
                if name == self.0 {
                    File::from_source(name, &self.1)
                } else {
                    Err(protox::Error::file_not_found(name))
                }
            }
        }
        let mut resolver = ChainFileResolver::new();
        resolver.add(Memory(file.to_owned(), source.to_owned()));
        resolver.add(GoogleFileResolver::new());
        let mut compiler = Compiler::with_file_resolver(resolver);
        compiler
            .open_file(file)
            .map_err(|e| format!("cannot compile {file}: {e:?}"))?;
        Ok(describe(&compiler.descriptor_pool(), file))
    }

    /// Every difference between two descriptions, one readable line each.
    pub fn diff(official: &Node, ours: &Node) -> Vec<String> {
        let mut out = Vec::new();
        diff_node("csi.proto", official, ours, &mut out);
        out
    }

    fn diff_node(path: &str, official: &Node, ours: &Node, out: &mut Vec<String>) {
        let keys = official.attrs.keys().chain(ours.attrs.keys());
        let mut seen = std::collections::BTreeSet::new();
        for key in keys.filter(|k| seen.insert(*k)) {
            let (a, b) = (official.attrs.get(key), ours.attrs.get(key));
            if a != b {
                let show = |v: Option<&String>| v.cloned().unwrap_or_else(|| "(unset)".into());
                out.push(format!(
                    "{path}: {key}: official {}, ours {}",
                    show(a),
                    show(b)
                ));
            }
        }
        for (key, a) in &official.children {
            match ours.children.get(key) {
                Some(b) => diff_node(&format!("{path} > {key}"), a, b, out),
                None => out.push(format!("{path} > {key}: missing from ours")),
            }
        }
        for key in ours.children.keys() {
            if !official.children.contains_key(key) {
                out.push(format!("{path} > {key}: not in the official spec"));
            }
        }
    }

    fn opt<T: Display>(value: &Option<T>) -> String {
        value
            .as_ref()
            .map_or_else(|| "(unset)".to_owned(), T::to_string)
    }

    fn sorted(items: impl IntoIterator<Item = String>) -> String {
        let mut items: Vec<String> = items.into_iter().collect();
        items.sort();
        format!("[{}]", items.join(", "))
    }

    /// The structure comes from the plain `FileDescriptorProto`s (destructured in
    /// full, so a field added to them by a new prost-types release fails to compile
    /// here instead of going unchecked); options come from the reflection pool,
    /// which keeps extension options that prost-types drops.
    fn describe(pool: &DescriptorPool, file_name: &str) -> Node {
        let file = pool
            .get_file_by_name(file_name)
            .unwrap_or_else(|| panic!("{file_name} is not in its own pool"));
        let FileDescriptorProto {
            name,
            package,
            dependency,
            public_dependency,
            weak_dependency,
            message_type,
            enum_type,
            service,
            extension,
            options: _,
            source_code_info: _,
            syntax,
        } = file.file_descriptor_proto();
        let scope = package.clone().unwrap_or_default();
        let by_index = |indices: &[i32]| {
            sorted(
                indices
                    .iter()
                    .map(|i| dependency.get(*i as usize).cloned().unwrap_or_default()),
            )
        };

        let mut node = Node::default();
        node.attr("name", opt(name));
        node.attr("package", opt(package));
        node.attr("syntax", opt(syntax));
        node.attr("imports", sorted(dependency.iter().cloned()));
        node.attr("public imports", by_index(public_dependency));
        node.attr("weak imports", by_index(weak_dependency));
        node.options(&file.options());
        for m in message_type {
            node.child(key("message", &m.name), message(pool, &scope, m));
        }
        for e in enum_type {
            node.child(key("enum", &e.name), enumeration(pool, &scope, e));
        }
        for s in service {
            node.child(key("service", &s.name), service_node(pool, &scope, s));
        }
        for x in extension {
            node.child(key("extension", &x.name), extension_node(pool, &scope, x));
        }
        node
    }

    fn key(kind: &str, name: &Option<String>) -> String {
        format!("{kind} {}", opt(name))
    }

    fn full_name(scope: &str, name: &Option<String>) -> String {
        match scope {
            "" => opt(name),
            _ => format!("{scope}.{}", opt(name)),
        }
    }

    fn message(pool: &DescriptorPool, scope: &str, m: &DescriptorProto) -> Node {
        let DescriptorProto {
            name,
            field,
            extension,
            nested_type,
            enum_type,
            extension_range,
            oneof_decl,
            options: _,
            reserved_range,
            reserved_name,
        } = m;
        let full = full_name(scope, name);
        let desc = pool
            .get_message_by_name(&full)
            .unwrap_or_else(|| panic!("message {full} is not in the pool"));

        let mut node = Node::default();
        node.options(&desc.options());
        node.attr(
            "extension ranges",
            sorted(extension_range.iter().map(|r| {
                let options = r.options.as_ref().map(|o| format!(" {o:?}"));
                format!(
                    "{}..{}{}",
                    opt(&r.start),
                    opt(&r.end),
                    options.unwrap_or_default()
                )
            })),
        );
        node.attr(
            "reserved ranges",
            sorted(
                reserved_range
                    .iter()
                    .map(|r| format!("{}..{}", opt(&r.start), opt(&r.end))),
            ),
        );
        node.attr("reserved names", sorted(reserved_name.iter().cloned()));

        for f in field {
            let field_desc = desc
                .get_field_by_name(&opt(&f.name))
                .unwrap_or_else(|| panic!("field {full}.{} is not in the pool", opt(&f.name)));
            let mut child = field_node(f, oneof_decl);
            child.options(&field_desc.options());
            node.child(key("field", &f.name), child);
        }
        for o in oneof_decl {
            let OneofDescriptorProto { name, options: _ } = o;
            let oneof_desc = desc
                .oneofs()
                .find(|d| Some(d.name()) == name.as_deref())
                .unwrap_or_else(|| panic!("oneof {full}.{} is not in the pool", opt(name)));
            let mut child = Node::default();
            child.options(&oneof_desc.options());
            node.child(key("oneof", name), child);
        }
        for n in nested_type {
            node.child(key("message", &n.name), message(pool, &full, n));
        }
        for e in enum_type {
            node.child(key("enum", &e.name), enumeration(pool, &full, e));
        }
        for x in extension {
            node.child(key("extension", &x.name), extension_node(pool, &full, x));
        }
        node
    }

    /// A field or an extension declaration; `oneofs` names the enclosing message's
    /// oneofs so that membership is compared by name, not by index.
    fn field_node(f: &FieldDescriptorProto, oneofs: &[OneofDescriptorProto]) -> Node {
        let FieldDescriptorProto {
            name: _,
            number,
            label,
            r#type,
            type_name,
            extendee,
            default_value,
            oneof_index,
            json_name,
            options: _,
            proto3_optional,
        } = f;
        let label = label.map(|l| {
            Label::try_from(l).map_or(format!("label {l}"), |l| l.as_str_name().to_owned())
        });
        let r#type = r#type
            .map(|t| Type::try_from(t).map_or(format!("type {t}"), |t| t.as_str_name().to_owned()));
        let oneof = oneof_index.map(|i| {
            oneofs
                .get(i as usize)
                .map_or(format!("#{i}"), |o| opt(&o.name))
        });

        let mut node = Node::default();
        node.attr("number", opt(number));
        node.attr("label", opt(&label));
        node.attr("type", opt(&r#type));
        node.attr("type_name", opt(type_name));
        node.attr("extendee", opt(extendee));
        node.attr("default_value", opt(default_value));
        node.attr("oneof", opt(&oneof));
        node.attr("json_name", opt(json_name));
        node.attr("proto3_optional", opt(proto3_optional));
        node
    }

    fn extension_node(pool: &DescriptorPool, scope: &str, x: &FieldDescriptorProto) -> Node {
        let full = full_name(scope, &x.name);
        let desc = pool
            .get_extension_by_name(&full)
            .unwrap_or_else(|| panic!("extension {full} is not in the pool"));
        let mut node = field_node(x, &[]);
        node.options(&desc.options());
        node
    }

    fn enumeration(pool: &DescriptorPool, scope: &str, e: &EnumDescriptorProto) -> Node {
        let EnumDescriptorProto {
            name,
            value,
            options: _,
            reserved_range,
            reserved_name,
        } = e;
        let full = full_name(scope, name);
        let desc = pool
            .get_enum_by_name(&full)
            .unwrap_or_else(|| panic!("enum {full} is not in the pool"));

        let mut node = Node::default();
        node.options(&desc.options());
        node.attr(
            "reserved ranges",
            sorted(
                reserved_range
                    .iter()
                    .map(|r| format!("{}..={}", opt(&r.start), opt(&r.end))),
            ),
        );
        node.attr("reserved names", sorted(reserved_name.iter().cloned()));
        for v in value {
            let EnumValueDescriptorProto {
                name,
                number,
                options: _,
            } = v;
            let value_desc = desc
                .get_value_by_name(&opt(name))
                .unwrap_or_else(|| panic!("value {full}.{} is not in the pool", opt(name)));
            let mut child = Node::default();
            child.attr("number", opt(number));
            child.options(&value_desc.options());
            node.child(key("value", name), child);
        }
        node
    }

    fn service_node(pool: &DescriptorPool, scope: &str, s: &ServiceDescriptorProto) -> Node {
        let ServiceDescriptorProto {
            name,
            method,
            options: _,
        } = s;
        let full = full_name(scope, name);
        let desc = pool
            .get_service_by_name(&full)
            .unwrap_or_else(|| panic!("service {full} is not in the pool"));

        let mut node = Node::default();
        node.options(&desc.options());
        for m in method {
            let MethodDescriptorProto {
                name,
                input_type,
                output_type,
                options: _,
                client_streaming,
                server_streaming,
            } = m;
            let method_desc = desc
                .methods()
                .find(|d| Some(d.name()) == name.as_deref())
                .unwrap_or_else(|| panic!("rpc {full}.{} is not in the pool", opt(name)));
            let mut child = Node::default();
            child.attr("input_type", opt(input_type));
            child.attr("output_type", opt(output_type));
            child.attr("client_streaming", client_streaming.unwrap_or(false));
            child.attr("server_streaming", server_streaming.unwrap_or(false));
            child.options(&method_desc.options());
            node.child(key("rpc", name), child);
        }
        node
    }
}

/// The `go` binary: the first on PATH, else the usual install location.
fn go_binary() -> PathBuf {
    let on_path = env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join("go"))
        .find(|candidate| candidate.is_file());
    on_path
        .or_else(|| Some(PathBuf::from(GO_FALLBACK)).filter(|p| p.is_file()))
        .unwrap_or_else(|| {
            panic!(
                "the contract test needs Go to fetch the official CSI spec \
                 ({SPEC_MODULE}@{SPEC_VERSION}), but `go` is neither on PATH nor at \
                 {GO_FALLBACK}; install Go (https://go.dev/dl/ or the golang-go package)"
            )
        })
}

/// The directory of the official spec module, downloaded (or found in the module
/// cache) with `go mod download -json`.
fn official_spec_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let go = go_binary();
        let module = format!("{SPEC_MODULE}@{SPEC_VERSION}");
        // Run outside any Go module, so that no go.mod around us is consulted.
        let output = Command::new(&go)
            .args(["mod", "download", "-json", &module])
            .current_dir(env::temp_dir())
            .env("GO111MODULE", "on")
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", go.display()));
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        let info: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
            panic!(
                "`go mod download -json {module}` ({}) printed no JSON ({e}).\n\
                 stdout:\n{stdout}\nstderr:\n{stderr}",
                output.status
            )
        });
        if let Some(error) = info.get("Error") {
            panic!("`go mod download -json {module}` failed: {error}\nstderr:\n{stderr}");
        }
        assert!(
            output.status.success(),
            "`go mod download -json {module}` exited with {}\nstderr:\n{stderr}",
            output.status
        );
        assert_eq!(
            info["Sum"].as_str(),
            Some(SPEC_SUM),
            "the downloaded {module} is not the one this test pins"
        );
        let dir = info["Dir"]
            .as_str()
            .unwrap_or_else(|| panic!("no \"Dir\" in the output of go mod download: {stdout}"));
        PathBuf::from(dir)
    })
}

fn our_proto_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn report(differences: &[String]) -> String {
    differences
        .iter()
        .map(|d| format!("  - {d}"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn our_proto_is_the_official_csi_v1_14_0_contract() {
    let official = contract::from_dir(official_spec_dir(), "csi.proto").unwrap();
    let ours = contract::from_dir(&our_proto_dir(), "csi.proto").unwrap();

    // Guard against a walk that describes nothing: the official tree must hold the
    // five services and the extension options the CSI spec is known for.
    assert!(official.count() > 500, "official spec looks empty");
    let secrets = official
        .at(&["message CreateVolumeRequest", "field secrets"])
        .expect("CreateVolumeRequest.secrets in the official spec");
    assert_eq!(
        secrets
            .attrs
            .get("option (csi.v1.csi_secret)")
            .map(String::as_str),
        Some("true"),
        "extension options are not decoded: {secrets:?}"
    );
    for service in [
        "Identity",
        "Controller",
        "GroupController",
        "SnapshotMetadata",
        "Node",
    ] {
        assert!(official
            .children
            .contains_key(&format!("service {service}")));
    }

    let differences = contract::diff(&official, &ours);
    assert!(
        differences.is_empty(),
        "proto/csi.proto differs from the official CSI {SPEC_VERSION} csi.proto \
         (in {}) in {} ways:\n{}",
        official_spec_dir().display(),
        differences.len(),
        report(&differences)
    );
}

/// One edit of the official text and the report lines it must cause.
struct Mutation {
    what: &'static str,
    /// The edit is made at the first `from` after the first `anchor`.
    anchor: &'static str,
    from: &'static str,
    to: &'static str,
    expect: &'static [&'static str],
}

impl Mutation {
    fn apply(&self, text: &str) -> String {
        let start = text
            .find(self.anchor)
            .unwrap_or_else(|| panic!("{}: anchor {:?} not found", self.what, self.anchor));
        let at = start
            + text[start..]
                .find(self.from)
                .unwrap_or_else(|| panic!("{}: {:?} not found", self.what, self.from));
        format!(
            "{}{}{}",
            &text[..at],
            self.to,
            &text[at + self.from.len()..]
        )
    }
}

const MUTATIONS: &[Mutation] = &[
    Mutation {
        what: "rename a field",
        anchor: "message GetPluginInfoResponse {",
        from: "string vendor_version = 2;",
        to: "string vendor_ver = 2;",
        expect: &[
            "message GetPluginInfoResponse > field vendor_version: missing from ours",
            "message GetPluginInfoResponse > field vendor_ver: not in the official spec",
        ],
    },
    Mutation {
        what: "renumber a field",
        anchor: "message ControllerPublishVolumeRequest {",
        from: "bool readonly = 4;",
        to: "bool readonly = 9;",
        expect: &["field readonly: number: official 4, ours 9"],
    },
    Mutation {
        what: "drop (csi_secret)",
        anchor: "message CreateVolumeRequest {",
        from: "secrets = 5 [(csi_secret) = true];",
        to: "secrets = 5;",
        expect: &[
            "message CreateVolumeRequest > field secrets: option (csi.v1.csi_secret): official true, ours (unset)",
        ],
    },
    Mutation {
        what: "flip (alpha_field)",
        anchor: "message GetCapacityResponse {",
        from: "[(alpha_field) = true]",
        to: "[(alpha_field) = false]",
        expect: &["field minimum_volume_size: option (csi.v1.alpha_field): official true, ours false"],
    },
    Mutation {
        what: "drop server streaming",
        anchor: "service SnapshotMetadata {",
        from: "returns (stream GetMetadataAllocatedResponse)",
        to: "returns (GetMetadataAllocatedResponse)",
        expect: &[
            "service SnapshotMetadata > rpc GetMetadataAllocated: server_streaming: official true, ours false",
        ],
    },
    Mutation {
        what: "add client streaming",
        anchor: "service Identity {",
        from: "rpc Probe (ProbeRequest)",
        to: "rpc Probe (stream ProbeRequest)",
        expect: &["service Identity > rpc Probe: client_streaming: official false, ours true"],
    },
    Mutation {
        what: "change an input type",
        anchor: "service Controller {",
        from: "rpc DeleteVolume (DeleteVolumeRequest)",
        to: "rpc DeleteVolume (ControllerUnpublishVolumeRequest)",
        expect: &["rpc DeleteVolume: input_type: official .csi.v1.DeleteVolumeRequest"],
    },
    Mutation {
        what: "renumber an enum value",
        anchor: "message VolumeExpansion {",
        from: "OFFLINE = 2;",
        to: "OFFLINE = 3;",
        expect: &["enum Type > value OFFLINE: number: official 2, ours 3"],
    },
    Mutation {
        what: "change the type of an enum field",
        anchor: "message ControllerUnpublishVolumeRequest {",
        from: "Reason reason = 4",
        to: "int32 reason = 4",
        expect: &[
            "message ControllerUnpublishVolumeRequest > field reason: type: official TYPE_ENUM, ours TYPE_INT32",
        ],
    },
    Mutation {
        what: "renumber a capability",
        anchor: "message ControllerServiceCapability {",
        from: "GET_NODE_INFO = 18",
        to: "GET_NODE_INFO = 19",
        expect: &["value GET_NODE_INFO: number: official 18, ours 19"],
    },
    Mutation {
        what: "drop (alpha_enum_value)",
        anchor: "message PluginCapability {",
        from: "SNAPSHOT_METADATA_SERVICE = 4 [(alpha_enum_value) = true];",
        to: "SNAPSHOT_METADATA_SERVICE = 4;",
        expect: &["value SNAPSHOT_METADATA_SERVICE: option (csi.v1.alpha_enum_value): official true"],
    },
    Mutation {
        what: "drop (alpha_method)",
        anchor: "rpc GetSnapshot (GetSnapshotRequest)",
        from: "option (alpha_method) = true;",
        to: "",
        expect: &["rpc GetSnapshot: option (csi.v1.alpha_method): official true, ours (unset)"],
    },
    Mutation {
        what: "drop (alpha_service)",
        anchor: "service SnapshotMetadata {",
        from: "option (alpha_service) = true;",
        to: "",
        expect: &["service SnapshotMetadata: option (csi.v1.alpha_service): official true"],
    },
    Mutation {
        what: "drop (alpha_message)",
        anchor: "message VolumeHealth {",
        from: "option (alpha_message) = true;",
        to: "",
        expect: &["message VolumeHealth: option (csi.v1.alpha_message): official true"],
    },
    Mutation {
        what: "bring a retired field back",
        anchor: "message NodeGetVolumeStatsResponse {",
        from: "reserved 2;",
        to: "string volume_condition = 2;",
        expect: &[
            "message NodeGetVolumeStatsResponse: reserved ranges: official [2..3], ours []",
            "message NodeGetVolumeStatsResponse > field volume_condition: not in the official spec",
        ],
    },
    Mutation {
        what: "bring a retired enum value back",
        anchor: "message NodeServiceCapability {",
        from: "reserved 4;",
        to: "VOLUME_CONDITION = 4;",
        expect: &["enum Type: reserved ranges: official [4..=4], ours []"],
    },
    Mutation {
        what: "renumber an extension",
        anchor: "extend google.protobuf.FieldOptions {",
        from: "bool csi_secret = 1059;",
        to: "bool csi_secret = 1061;",
        expect: &["extension csi_secret: number: official 1059, ours 1061"],
    },
    Mutation {
        what: "change a field type",
        anchor: "message Volume {",
        from: "int64 capacity_bytes = 1;",
        to: "uint64 capacity_bytes = 1;",
        expect: &["field capacity_bytes: type: official TYPE_INT64, ours TYPE_UINT64"],
    },
    Mutation {
        what: "change a label",
        anchor: "message MountVolume {",
        from: "repeated string mount_flags = 2;",
        to: "string mount_flags = 2;",
        expect: &["field mount_flags: label: official LABEL_REPEATED, ours LABEL_OPTIONAL"],
    },
    Mutation {
        what: "rename a oneof",
        anchor: "message VolumeContentSource {",
        from: "oneof type {",
        to: "oneof kind {",
        expect: &[
            "message VolumeContentSource > field snapshot: oneof: official type, ours kind",
            "message VolumeContentSource > oneof type: missing from ours",
        ],
    },
    Mutation {
        what: "change go_package",
        anchor: "option go_package",
        from: "lib/go/csi\"",
        to: "lib/go/csi/v2\"",
        expect: &["csi.proto: option go_package: official"],
    },
    Mutation {
        what: "add a message",
        anchor: "message ProbeRequest {",
        from: "message ProbeRequest {",
        to: "message Extra {}\nmessage ProbeRequest {",
        expect: &["csi.proto > message Extra: not in the official spec"],
    },
];

#[test]
fn checker_reports_each_kind_of_difference() {
    let dir = official_spec_dir();
    let text = std::fs::read_to_string(dir.join("csi.proto")).unwrap();
    let official = contract::from_dir(dir, "csi.proto").unwrap();

    // The in-memory loader used for the mutants sees the same contract as the file
    // loader used for the real comparison.
    let same = contract::from_source("csi.proto", &text).unwrap();
    assert_eq!(contract::diff(&official, &same), Vec::<String>::new());

    let mut failures = Vec::new();
    for mutation in MUTATIONS {
        let mutant = contract::from_source("csi.proto", &mutation.apply(&text))
            .unwrap_or_else(|e| panic!("{}: the mutant does not compile: {e}", mutation.what));
        let differences = contract::diff(&official, &mutant);
        for expected in mutation.expect {
            if !differences.iter().any(|d| d.contains(expected)) {
                failures.push(format!(
                    "{}: expected a line containing {expected:?}, got:\n{}",
                    mutation.what,
                    report(&differences)
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
