//go:build invariants

package kvcache

const invariantsOn = true
