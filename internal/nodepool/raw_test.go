package nodepool

import (
	"net"

	"github.com/kvoffload/kvoffload/internal/nodepool/wire"
)

// rawHello sends a Hello of the given version and returns the node's
// answer as a client error.
func rawHello(socket string, version uint16) error {
	uc, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: socket, Net: "unixpacket"})
	if err != nil {
		return err
	}
	conn := wire.NewConn(uc)
	defer conn.Close()
	if err := conn.Send(&wire.Msg{Type: wire.THello, ReqID: 1, Version: version, Namespace: "test", Layout: testLayout}, -1); err != nil {
		return err
	}
	var m wire.Msg
	if _, err := conn.Recv(&m); err != nil {
		return err
	}
	if m.Type == wire.TError {
		return replyErr(&m)
	}
	return nil
}
