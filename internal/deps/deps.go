package deps

import (
	_ "github.com/dgraph-io/ristretto/v2"
	_ "github.com/schollz/progressbar/v3"
	_ "github.com/stretchr/testify/require"
	_ "go.uber.org/goleak"
	_ "golang.org/x/sys/unix"
	_ "pgregory.net/rapid"
)
