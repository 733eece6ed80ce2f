"""Reports rendered from plain data: the terminal table, report.md (with Mermaid charts), report.json, changes.png,
the HTML page; two runs compared; exports for dashboards (Bencher Metric Format, PyTorch benchmark records).

Never imports the pytest plugin: the plugin hands a :class:`~vramgate.report.summary.Summary` over.
"""

from vramgate.report.chart import changed_bars
from vramgate.report.compare import (
    ComparedMetric,
    Comparison,
    compare_report_files,
    compare_reports,
    load_report,
)
from vramgate.report.data import (
    junit_properties,
    merge_report_files,
    report_data,
    write_report,
    write_report_data,
)
from vramgate.report.export import (
    export_text,
    parse_export,
    to_bmf,
    to_pytorch,
)
from vramgate.report.html import check_history, html_page, load_history
from vramgate.report.markdown import markdown
from vramgate.report.table import plan_baseline_lines, plan_lines, rows_of, text_table
from vramgate.report.terminal import failure_message, terminal_summary
from vramgate.store.report_files import Report, ReportError, read_report

__all__ = [ "ComparedMetric",
    "Comparison", "Report", "ReportError", "changed_bars", "check_history", "compare_report_files", "compare_reports",
    "export_text", "failure_message", "html_page", "junit_properties", "load_history",
    "load_report", "markdown", "merge_report_files", "parse_export",
    "plan_baseline_lines", "plan_lines", "read_report", "report_data", "rows_of",
    "terminal_summary", "text_table", "to_bmf", "to_pytorch", "write_report", "write_report_data",
]
