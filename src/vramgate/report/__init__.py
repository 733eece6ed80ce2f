"""Reports rendered from plain data: the terminal table, report.md (with Mermaid charts), report.json, changes.png,
the HTML page; two runs compared; exports for dashboards (Bencher Metric Format, PyTorch benchmark records).

Never imports the pytest plugin: the plugin hands a :class:`~vramgate.report.summary.Summary` over.
"""

from vramgate.report.chart import Bar, changed_bars, plot_changes
from vramgate.report.compare import (
    ComparedMetric,
    Comparison,
    RunFacts,
    compare_report_files,
    compare_reports,
    load_report,
)
from vramgate.report.data import (
    ReportError,
    junit_properties,
    merge_report_files,
    merge_reports,
    report_data,
    write_report,
    write_report_data,
)
from vramgate.report.export import (
    EXPORT_FILES,
    EXPORT_FORMATS,
    ExportedMetric,
    export_text,
    exported_metrics,
    parse_export,
    to_bmf,
    to_pytorch,
)
from vramgate.report.html import check_history, html_page, load_history
from vramgate.report.markdown import markdown
from vramgate.report.mermaid import mermaid_section, xychart
from vramgate.report.summary import (
    ACCEPTABLE,
    VERDICT_ORDER,
    CheckedMetric,
    Hardware,
    NodeSummary,
    Summary,
    accept_command,
    pytest_command,
    verdict_rank,
)
from vramgate.report.table import Row, aligned, plan_baseline_lines, plan_lines, rows_of, text_table
from vramgate.report.terminal import failure_message, terminal_summary

__all__ = [
    "ACCEPTABLE", "EXPORT_FILES", "EXPORT_FORMATS", "VERDICT_ORDER", "Bar", "CheckedMetric", "ComparedMetric",
    "Comparison", "ExportedMetric", "Hardware", "NodeSummary", "ReportError", "Row", "RunFacts", "Summary",
    "accept_command", "aligned", "changed_bars", "check_history", "compare_report_files", "compare_reports",
    "export_text", "exported_metrics", "failure_message", "html_page", "junit_properties", "load_history",
    "load_report", "markdown", "merge_report_files", "merge_reports", "mermaid_section", "parse_export",
    "plan_baseline_lines", "plan_lines", "plot_changes", "pytest_command", "report_data", "rows_of",
    "terminal_summary", "text_table", "to_bmf", "to_pytorch", "verdict_rank", "write_report", "write_report_data",
    "xychart",
]
