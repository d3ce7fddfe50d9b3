"""The judging: the rules that turn an actual and an expected output into a row. Exact and
tolerance comparisons and near-ties (compare), how a dtype judges rows and the routing watch
(regime), acceptance per depth (acceptance), declared deviations (deviations), the known
prefixes of a served request (prefixes), and the statistical test of a sampler's law
(distribution, which needs scipy). Imports only the reports."""
