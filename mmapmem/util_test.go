package mmapmem_test

import "errors"

func errIs(err, target error) bool { return errors.Is(err, target) }
