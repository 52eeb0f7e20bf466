"""A Griffe extension: Sphinx roles in deviceop's docstrings become cross-references.

deviceop's docstrings name other objects with Sphinx roles (``:class:`UsageError```,
``:func:`~deviceop.interop.torch```), which read well in ``help()``. mkdocstrings renders
Markdown, where a role would show as raw text; this rewrites each role, once the package is
loaded, into an autorefs link (``[UsageError][deviceop.UsageError]``) to the object it names,
resolved from where the docstring is: the object's own class and module, then the package and
its public subpackages. A name that resolves to nothing documented stays code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|exc|data|obj):`(~?)([A-Za-z_][\w.]*)(\(\))?`")
_PUBLIC = ("deviceop", "deviceop.executors", "deviceop.graph", "deviceop.interop", "deviceop.kernels")


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles in every docstring of the package into autorefs links."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        root = pkg.path

        def find(path: str) -> Any:
            head, _, rest = path.partition(".")
            if head != root:
                return None
            obj: Any = pkg
            for part in rest.split(".") if rest else []:
                try:
                    obj = obj.members[part]
                except Exception:  # not there, or an alias Griffe cannot resolve: no link
                    return None
            return obj

        def same(a: Any, b: Any) -> bool:
            # one object under two names (a public re-export of a private module's object)
            try:
                return bool(getattr(a, "target_path", a.path) == getattr(b, "target_path", b.path))
            except Exception:
                return False

        def public(path: str) -> bool:
            # documented on the API pages: a public subpackage or a public member of one
            return any(path == p or (path.startswith(p + ".") and "._" not in path[len(p) :]) for p in _PUBLIC)

        def resolve(name: str, where: Any) -> str | None:
            scopes = []
            o = where
            while o is not None:
                scopes.append(o.path)
                o = o.parent
            scopes += list(_PUBLIC)
            for scope in [*scopes, ""]:
                cand = f"{scope}.{name}" if scope else name
                if find(cand) is not None and public(cand):
                    return cand
                # a private module's object re-exported by a public package: link the public name
                last = name.rsplit(".", 1)[-1]
                here = find(cand)
                if here is None:
                    continue
                for p in _PUBLIC:
                    pub = find(f"{p}.{last}")
                    if pub is not None and same(pub, here):
                        return f"{p}.{last}"
            return None

        def rewrite(obj: Any) -> None:
            ds = getattr(obj, "docstring", None)
            if ds is not None and ":" in ds.value:

                def link(m: re.Match[str]) -> str:
                    tilde, name, call = m.group(1), m.group(2), m.group(3) or ""
                    shown = (name.rsplit(".", 1)[-1] if tilde else name) + call
                    target = resolve(name, obj if obj.is_module or obj.is_class else obj.parent)
                    return f"[`{shown}`][{target}]" if target else f"`{shown}`"

                ds.value = _ROLE.sub(link, ds.value)
            for m in getattr(obj, "members", {}).values():
                if not m.is_alias:
                    rewrite(m)

        rewrite(pkg)
