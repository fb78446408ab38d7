"""Custom import-linter contracts: some modules may use only another package's public modules, or only a few
named modules and the standard library.

``no_private``: no module under ``importers`` imports (directly) a module of
``package`` whose dotted name has a ``_``-private part (``stead.core.rpc._proto``,
``stead.core.store._common``). Wildcards of import-linter replace whole module
names only, so "any private module" cannot be written as a ``forbidden`` contract.

``imports_only``: see :class:`ImportsOnly`.
"""

from __future__ import annotations

import sys
from typing import Any

from importlinter import Contract, ContractCheck, fields, output
from importlinter.domain import helpers


def _private(module: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in module.split("."))


class NoPrivateImports(Contract):
    type_name = "no_private"

    importers = fields.ListField(subfield=fields.ModuleExpressionField())
    package = fields.StringField()

    def check(self, graph: Any, verbose: bool) -> ContractCheck:
        roots = {m.name for m in helpers.module_expressions_to_modules(graph, self.importers)}  # type: ignore[arg-type]
        importers = set(roots)
        for root in roots:
            importers |= graph.find_descendants(root)
        prefix = f"{self.package}."
        violations = sorted(
            (importer, imported)
            for importer in importers
            for imported in graph.find_modules_directly_imported_by(importer)
            if imported.startswith(prefix) and _private(imported)
        )
        return ContractCheck(kept=not violations, metadata={"violations": violations})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for importer, imported in check.metadata["violations"]:
            output.print_error(f"{importer} imports the private module {imported}: use the public API "
                               "(stead.plugin re-exports what plugins need)")
            output.new_line()


class ImportsOnly(Contract):
    """``imports_only``: the modules under ``importers`` import (directly) only each other, the modules named in
    ``allowed`` (with their descendants) and the standard library.

    A ``forbidden`` contract names what may not be imported; this one names what may, so that a module added to
    the package later is refused too. It needs ``include_external_packages = true``: without the standard
    library and third-party packages in the graph it could not see an import of one.
    """

    type_name = "imports_only"

    importers = fields.ListField(subfield=fields.ModuleExpressionField())
    allowed = fields.ListField(subfield=fields.ModuleExpressionField())

    def check(self, graph: Any, verbose: bool) -> ContractCheck:
        roots = {m.name for m in helpers.module_expressions_to_modules(graph, self.importers)}  # type: ignore[arg-type]
        allowed = roots | {m.name for m in helpers.module_expressions_to_modules(graph, self.allowed)}  # type: ignore[arg-type]
        if "typing" not in graph.modules:
            raise ValueError("the imports_only contract needs include_external_packages = true in "
                             "[tool.importlinter] to see imports of the standard library and other packages")
        importers = set(roots)
        for root in roots:
            importers |= graph.find_descendants(root)
        violations = sorted(
            (importer, imported)
            for importer in importers
            for imported in graph.find_modules_directly_imported_by(importer)
            if not any(imported == a or imported.startswith(f"{a}.") for a in allowed)
            and imported.split(".")[0] not in sys.stdlib_module_names
        )
        return ContractCheck(kept=not violations, metadata={"violations": violations, "allowed": sorted(allowed)})

    def render_broken_contract(self, check: ContractCheck) -> None:
        allowed = ", ".join(check.metadata["allowed"])
        for importer, imported in check.metadata["violations"]:
            output.print_error(f"{importer} imports {imported}: it may import only {allowed} and the standard "
                               "library; pass what it needs in as values instead")
            output.new_line()
