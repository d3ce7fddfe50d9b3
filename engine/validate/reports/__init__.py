"""The reports: the row (`Check`), the report and its JSON form (report), JUnit XML (junit) and a
self-contained HTML page (html), and a run's report files, written staged and published with its
verdict (files). The bottom of the validator: imports nothing of it."""
