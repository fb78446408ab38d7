"""Views of a job computed from its event log, for people and their tools: the typed recovery view
(:mod:`.recovery`) that every other view reads recoveries from, the goodput ledger, OpenTelemetry traces,
Prometheus metrics, the HTML report, ``stead top`` and the CLI's one-line renderings. Each is a fold or a
rendering of records; none changes the job."""
