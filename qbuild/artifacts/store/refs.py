"""Names: refs (recipe/variant:tag → digest), resolving a name, and each named step's last build (why a step misses)."""

from __future__ import annotations

import re
from pathlib import Path

from qbuild.artifacts.store.files import now_iso, read_json
from qbuild.artifacts.store.layout import DIGEST_RE, REF_RE
from qbuild.base.errors import UserError
from qbuild.base.names import check_name


class RefsMixin:
    """Store methods: names: refs (recipe/variant:tag → digest), resolving a name, and each named step's last build
    (why a step misses)."""

    # --- history (for `plan` explanations) ----------------------------------------------------------
    def _history_file(self, recipe: str, step_name: str) -> Path:
        safe = re.sub(r"[^\w.\-\[\]]", "_", step_name)
        return self.root / "history" / recipe / f"{safe}.json"

    def last_build(self, recipe: str, step_name: str) -> dict | None:
        return read_json(self._history_file(recipe, step_name))

    def remember_build(self, recipe: str, step_name: str, record: dict) -> None:
        if self.writable:
            self.write_json(self._history_file(recipe, step_name), record)

    # --- refs ------------------------------------------------------------------------------------------
    def set_ref(self, recipe: str, variant: str, tag: str, digest: str, key: str) -> None:
        for what, value in (("recipe", recipe), ("variant", variant), ("tag", tag)):
            check_name(value, what)
        current = self.get_ref(recipe, variant, tag)
        if current and current.get("digest") == digest and current.get("key") == key:
            return  # already there: a fully cached run rewrites (and fsyncs) nothing
        self.write_json(self.root / "refs" / recipe / variant / tag, {"digest": digest, "key": key, "updated": now_iso()})

    def get_ref(self, recipe: str, variant: str, tag: str) -> dict | None:
        data = read_json(self.root / "refs" / recipe / variant / tag)
        return data if data and isinstance(data.get("digest"), str) and DIGEST_RE.match(data["digest"]) else None

    def refs(self) -> list[dict]:
        out = []
        base = self.root / "refs"
        for f in sorted(base.glob("*/*/*")):
            if f.name.startswith(".") or not f.is_file():
                continue
            data = read_json(f)
            if data is None or not isinstance(data.get("digest"), str) or not DIGEST_RE.match(data["digest"]):
                continue
            recipe, variant, tag = f.relative_to(base).parts
            out.append({"ref": f"{recipe}/{variant}:{tag}", **data})
        return out

    def list_refs(self) -> list[dict]:   # the reading interface shared with remotes
        return self.refs()

    def resolve(self, name: str) -> str:
        """Ref (recipe/variant[:tag]), full digest, 'sha256:'-prefixed digest, or a unique prefix (≥ 8)."""
        m = REF_RE.match(name)
        if m:
            tag = m.group("tag") or "latest"
            ref = self.get_ref(m.group("recipe"), m.group("variant"), tag)
            if ref is None:
                raise UserError(f"no ref {m.group('recipe')}/{m.group('variant')}:{tag} in store {self.root}")
            return ref["digest"]
        hexpart = name.removeprefix("sha256:").lower()
        if not re.fullmatch(r"[0-9a-f]{8,64}", hexpart):
            raise UserError(f"{name!r} is neither a ref (recipe/variant:tag) nor a digest")
        matches = [p.name for p in (self.root / "objects" / hexpart[:2]).glob(f"{hexpart}*")]
        if not matches:
            action = read_json(self._action_file(hexpart)) if len(hexpart) == 64 else None
            if action and isinstance(action.get("digest"), str) and DIGEST_RE.match(action["digest"]):
                return action["digest"]
            raise UserError(f"no object {name} in store {self.root}")
        if len(matches) > 1:
            raise UserError(f"digest prefix {name} is ambiguous ({len(matches)} objects)")
        return matches[0]
