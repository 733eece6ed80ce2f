"""The gate's own precision: false alarms and detections, on engine latency and on one kernel."""
