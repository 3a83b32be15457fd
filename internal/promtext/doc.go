// Package promtext is the daemons' metrics registry and its Prometheus text
// exposition: counters, gauges, histograms and scrape-time functions with
// fixed label sets, written in the text format (version 0.0.4) that
// Prometheus and the upstream dashboards read.
//
// It sits under tunnel/ because tunnel is its first user, but it knows
// nothing of tunnel: tunnel, internal/lease, auth, certs and package main
// all register into one Registry, which the health and admin ports serve.
//
// Rules: updates are atomic adds with no lock on the per-dial path; a
// scrape takes the registry's lock, runs the OnScrape hooks, then writes
// families sorted by name. Metric names, label names and the exposition's
// bytes are an operator contract: e2e checks them with the Prometheus
// parser. The package owns no goroutine, keeps no package-level mutable
// state, and imports only the standard library.
package promtext
