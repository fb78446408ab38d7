"""A custom import-linter contract: some modules may use only another package's public modules.

``no_private``: no module under ``importers`` imports (directly) a module of
``package`` whose dotted name has a ``_``-private part (``stead.core.rpc._proto``,
``stead.core.store._common``). Wildcards of import-linter replace whole module
names only, so "any private module" cannot be written as a ``forbidden`` contract.
"""

from __future__ import annotations

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
