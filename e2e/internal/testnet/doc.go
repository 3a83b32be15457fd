// Package testnet serves the loopback listeners tests need: each accepted
// connection is tracked so that Close ends the listener, every open
// connection and every handler before it returns. Only tests import it.
//
// Rules: a Server owns its accept goroutine and one goroutine per
// connection; Close is their end, and no goroutine outlives it.
package testnet
