//go:build !invariants

package kvcache

const invariantsOn = false
