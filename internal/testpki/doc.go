// Package testpki mints throwaway certificate authorities and the
// certificates they sign, for tests alone: ECDSA P-256, valid from an hour
// ago for two hours.
package testpki
