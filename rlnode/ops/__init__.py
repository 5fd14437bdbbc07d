"""Operations surface: systemd notification (notify.py) and the per-daemon
HTTP endpoint with health, Prometheus metrics, status and a live page
(http.py, dashboard.html)."""
