//go:build !kvoinvariants

package kvcache

// invariantsOn: see invariants_on.go.
const invariantsOn = false
