"""Read from upstream's Go types what the descriptors cannot say about a field's JSON form.

- `pointers`: optional (pointer) fields. k8s.io's protobuf writes every non-pointer field, zero or not, while
  its JSON leaves zero `omitempty` fields out; a pointer field is written only when set, and then its zero
  (`replicas: 0`) matters.
- `json_names`: fields whose protobuf name is not their JSON name (`Variable.Name` is `name`).
- `inline`: embedded structs (`json:""`, `json:",inline"`) whose fields are their parent's in JSON.

    python proto/kubernetes/go_fields.py ~/go/pkg/mod/k8s.io > fakes/apiserver/kubernetes_fields.json
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

_STRUCT = re.compile(r"^type (\w+) struct \{")
_FIELD = re.compile(r'^\s+(?:\w+\s+)?(\*?)([\w.\[\]*]+)\s+`json:"([^",]*)[^"]*"[^`]*protobuf:"([^"]*)"')
_NAME = re.compile(r"name=(\w+)")
PACKAGES = {
    "k8s.io.api.core.v1": "api@v0.37.2/core/v1",
    "k8s.io.api.apps.v1": "api@v0.37.2/apps/v1",
    "k8s.io.api.rbac.v1": "api@v0.37.2/rbac/v1",
    "k8s.io.api.admissionregistration.v1": "api@v0.37.2/admissionregistration/v1",
    "k8s.io.api.events.v1": "api@v0.37.2/events/v1",
    "k8s.io.api.coordination.v1": "api@v0.37.2/coordination/v1",
    "k8s.io.api.resource.v1": "api@v0.37.2/resource/v1",
    "k8s.io.api.scheduling.v1beta1": "api@v0.37.2/scheduling/v1beta1",
    "k8s.io.api.policy.v1": "api@v0.37.2/policy/v1",
    "k8s.io.apimachinery.pkg.apis.meta.v1": "apimachinery@v0.37.2/pkg/apis/meta/v1",
}


def go_fields(root: Path) -> dict[str, object]:
    pointers: list[str] = []
    json_names: dict[str, str] = {}
    inline: list[str] = []
    for package, directory in PACKAGES.items():
        struct = ""
        for line in (root / directory / "types.go").read_text().splitlines():
            if m := _STRUCT.match(line):
                struct = m.group(1)
                continue
            m = _FIELD.match(line)
            if not m or not struct:
                continue
            pointer, go_type, json_name, tag = m.groups()
            named = _NAME.search(tag)
            # An embedded struct without name= is named after its type, first letter lowered (protoc-gen-gogo).
            proto_name = named.group(1) if named else go_type[0].lower() + go_type[1:]
            key = f"{package}.{struct}.{proto_name}"
            if not json_name:
                inline.append(key)
            elif json_name != proto_name:
                json_names[key] = json_name
            if pointer:
                pointers.append(key)
    return {"pointers": sorted(pointers), "json_names": dict(sorted(json_names.items())), "inline": sorted(inline)}


if __name__ == "__main__":
    json.dump(go_fields(Path(sys.argv[1])), sys.stdout, indent=0)
    sys.stdout.write("\n")
