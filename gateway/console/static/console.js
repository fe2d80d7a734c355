// The console's only script: Chart.js charts from server-rendered JSON, and the copy button.
// htmx.onLoad runs for the page and for every fragment htmx swaps in.
(function () {
  "use strict";

  function css(name) {
    return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  }

  function drawCharts(root) {
    if (typeof Chart === "undefined") return;
    root.querySelectorAll(".chart-data").forEach(function (script) {
      var data = JSON.parse(script.textContent);
      var scope = script.parentElement;
      var common = {
        animation: false, responsive: true, maintainAspectRatio: false,
        interaction: { mode: "index", intersect: false },
        plugins: { legend: { position: "bottom" } },
        scales: { x: { ticks: { maxRotation: 0, autoSkip: true, maxTicksLimit: 8 } },
                  y: { beginAtZero: true } }
      };
      var tokens = scope.querySelector("canvas[data-chart=tokens]");
      if (tokens && !Chart.getChart(tokens)) {
        new Chart(tokens, {
          type: "bar", options: Object.assign({}, common, {
            scales: { x: Object.assign({ stacked: true }, common.scales.x),
                      y: { stacked: true, beginAtZero: true } } }),
          data: { labels: data.days, datasets: [
            { label: "Prompt tokens", data: data.prompt_tokens, backgroundColor: css("--c1") },
            { label: "Completion tokens", data: data.completion_tokens, backgroundColor: css("--c2") }
          ] }
        });
      }
      var cost = scope.querySelector("canvas[data-chart=cost]");
      if (cost && !Chart.getChart(cost)) {
        var dollars = function (value) {
          return "$" + (value >= 1 ? value.toFixed(2) : Number(value.toPrecision(2)).toString());
        };
        new Chart(cost, {
          type: "line", options: Object.assign({}, common, { scales: {
            x: common.scales.x, y: { beginAtZero: true, ticks: { callback: dollars } } } }),
          data: { labels: data.days, datasets: [
            { label: "Cost (USD)", data: data.cost_usd, borderColor: css("--c3"),
              backgroundColor: css("--c3"), tension: 0.2, pointRadius: 2 }
          ] }
        });
      }
    });
  }

  function destroyCharts(root) {
    if (typeof Chart === "undefined" || !root) return;
    root.querySelectorAll("canvas").forEach(function (canvas) {
      var chart = Chart.getChart(canvas);
      if (chart) chart.destroy();
    });
  }

  function copy(button) {
    var source = document.querySelector(button.getAttribute("data-copy"));
    if (!source) return;
    var text = source.textContent.trim();
    var done = function () { button.textContent = "Copied"; };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done, function () { select(source); });
    } else {
      select(source);
    }
  }

  function select(node) {  // no clipboard API (plain http): select it for Ctrl+C
    var range = document.createRange();
    range.selectNodeContents(node);
    var selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
  }

  document.addEventListener("click", function (event) {
    var button = event.target.closest("[data-copy]");
    if (button) copy(button);
  });
  document.addEventListener("htmx:beforeSwap", function (event) {
    destroyCharts(event.detail.target);
  });
  // Registered before htmx's own start-up (DOMContentLoaded), so the first page counts too.
  htmx.onLoad(drawCharts);
})();
