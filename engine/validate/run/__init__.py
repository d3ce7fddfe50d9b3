"""Running a validation: every section of a fixture directory in order, or one case at a time
(runner: `plan`, `Validation`, `validate`); the run inside the supervised child process
(isolated); a serving engine over HTTP (server: `kdtree validate --server`). The top of the
validator: it imports the rows, the door, the judging and the reports, and nothing imports it
but the CLI, the pytest plugin and the package's public names."""
